"""Speculative decoding's acceptance, counted from a draft's proposals over a token stream.

vLLM's EAGLE-3 loop, for one request at temperature 0: the verifier's prefill yields the
first output token; from then on, with the verifier's states known up to position i and the
token x_{i+1} known (the "anchor" i), the draft proposes k tokens in a chain, the verifier
accepts the longest prefix that matches its greedy tokens x_{i+2..i+k+1} and adds one token
of its own, and the next anchor is i + accepted + 1. `proposals[s][i]` is the token the
draft proposes at chain step s from anchor i (benchmark.replay computes them for every
anchor at once). Walking the anchors vLLM visits counts what vLLM counts; averaging over
every anchor is what the training-time estimate (1 + sum_k full_acc_k) measures.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class AcceptanceCounts:
    """Drafts proposed and tokens accepted at each chain position, summed over streams."""

    k: int
    drafts: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.accepted_per_pos:
            self.accepted_per_pos = [0] * self.k

    def add(self, other: AcceptanceCounts) -> None:
        self.drafts += other.drafts
        self.accepted_per_pos = [a + b for a, b in zip(self.accepted_per_pos, other.accepted_per_pos, strict=True)]

    def summary(self) -> dict[str, float | list[float]]:
        """The figures vLLM's counters give (benchmark.metrics.acceptance), from these counts."""
        return acceptance_figures(self.drafts, self.drafts * self.k, sum(self.accepted_per_pos), self.accepted_per_pos)


def acceptance_figures(
    drafts: float, draft_tokens: float, accepted: float, accepted_per_pos: Sequence[float]
) -> dict[str, float | list[float]]:
    """Mean acceptance length (1 + accepted / drafts: the bonus token the verifier always adds),
    acceptance rate and per-position rates from counts, as vLLM's counters or a replay give
    them. No draft counts as one, so that nothing divides by zero. Pure."""
    per_draft = max(1.0, drafts)
    return {
        "num_drafts": drafts,
        "num_draft_tokens": draft_tokens,
        "num_accepted_tokens": accepted,
        "mean_acceptance_length": 1.0 + accepted / per_draft,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
        "per_position_acceptance": [a / per_draft for a in accepted_per_pos],
    }


def accepted_at(tokens: Sequence[int], proposals: Sequence[Sequence[int]], anchor: int, end: int) -> int:
    """How many of the chain proposed at `anchor` match the stream: proposals[s][anchor]
    against tokens[anchor + 2 + s], stopping at the first miss or at `end`. Pure."""
    n = 0
    for chain in proposals:
        position = anchor + 2 + n
        if position >= end or chain[anchor] != tokens[position]:
            break
        n += 1
    return n


def walk(
    tokens: Sequence[int], start: int, proposals: Sequence[Sequence[int]], end: int | None = None
) -> AcceptanceCounts:
    """The anchors vLLM visits while it generates tokens[start:end] (default: to the stream's
    end) after tokens[:start], and what each accepts. Pure.

    The first anchor is start - 1 (prefill produced tokens[start]); a step that accepts a
    tokens moves the anchor a + 1 on. A draft is counted while a token is still to be
    generated after the anchor's known one; proposals past `end` cannot be checked and count
    as rejected (vLLM checks them against tokens it then drops at max_tokens: the last draft
    of a stream may differ)."""
    end = len(tokens) if end is None else end
    counts = AcceptanceCounts(k=len(proposals))
    anchor = start - 1
    while anchor + 2 < end:
        a = accepted_at(tokens, proposals, anchor, end)
        counts.drafts += 1
        for s in range(a):
            counts.accepted_per_pos[s] += 1
        anchor += a + 1
    return counts


def every_anchor(
    tokens: Sequence[int], start: int, proposals: Sequence[Sequence[int]], end: int | None = None
) -> AcceptanceCounts:
    """Every anchor of tokens[start:end], visited or not: the training-time estimate's average. Pure."""
    end = len(tokens) if end is None else end
    counts = AcceptanceCounts(k=len(proposals))
    for anchor in range(start - 1, end - 2):
        counts.drafts += 1
        for s in range(accepted_at(tokens, proposals, anchor, end)):
            counts.accepted_per_pos[s] += 1
    return counts


def generated_spans(loss_mask: Sequence[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of verifier-generated tokens (loss mask 1): one per assistant
    turn of a conversation. Pure."""
    spans, start = [], None
    for i, m in enumerate([*loss_mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans
