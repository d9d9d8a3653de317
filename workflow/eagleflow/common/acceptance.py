"""Speculative decoding's acceptance, counted from a draft's proposals over a token stream.

vLLM's EAGLE-3 loop, for one request at temperature 0: the verifier's prefill yields the
first output token; from then on, with the verifier's states known up to position i and the
token x_{i+1} known (the "anchor" i), the draft proposes k tokens in a chain, the verifier
accepts the longest prefix that matches its greedy tokens x_{i+2..i+k+1} and adds one token
of its own, and the next anchor is i + accepted + 1. `proposals[s][i]` is the token the
draft proposes at chain step s from anchor i (train.proposals computes them for every
anchor at once). Walking the anchors vLLM visits counts what vLLM counts; averaging over
every anchor is what the training-time estimate (1 + sum_k full_acc_k) measures.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class AcceptanceCounts:
    """Drafts proposed and tokens accepted at each chain position, summed over streams."""

    k: int
    drafts: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.accepted_per_pos:
            self.accepted_per_pos = [0] * self.k

    def count(self, accepted: int) -> None:
        """One draft, of which the first `accepted` tokens were accepted."""
        self.drafts += 1
        for s in range(accepted):
            self.accepted_per_pos[s] += 1

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


def visited_anchors(
    tokens: Sequence[int], start: int, proposals: Sequence[Sequence[int]], end: int | None = None
) -> Iterator[tuple[int, int]]:
    """(anchor, tokens accepted there) for each anchor vLLM visits while it generates
    tokens[start:end] (default: to the stream's end) after tokens[:start]. Pure.

    The first anchor is start - 1 (prefill produced tokens[start]); a step that accepts a
    tokens moves the anchor a + 1 on. A draft is counted while a token is still to be
    generated after the anchor's known one; proposals past `end` cannot be checked and count
    as rejected (vLLM checks them against tokens it then drops at max_tokens: the last draft
    of a stream may differ)."""
    end = len(tokens) if end is None else end
    anchor = start - 1
    while anchor + 2 < end:
        a = accepted_at(tokens, proposals, anchor, end)
        yield anchor, a
        anchor += a + 1


def walk(
    tokens: Sequence[int], start: int, proposals: Sequence[Sequence[int]], end: int | None = None
) -> AcceptanceCounts:
    """What the anchors vLLM visits (visited_anchors) accept, counted. Pure."""
    counts = AcceptanceCounts(k=len(proposals))
    for _, a in visited_anchors(tokens, start, proposals, end):
        counts.count(a)
    return counts


def context_edges(max_len: int, first: int = 128) -> list[int]:
    """Bucket edges of context length: 0, then powers of two from `first` up to the first at
    or past `max_len`. Fixed edges, so that two runs' tables line up. Pure."""
    edges, edge = [0], first
    while edges[-1] < max_len:
        edges.append(edge)
        edge *= 2
    return edges


@dataclass
class ContextBuckets:
    """Acceptance by the context length a draft was proposed at: the tokens the verifier has
    seen at the anchor (anchor + 2: the prompt, what was generated, and the anchor's known
    next token), bucketed by `edges` ([lo, hi); the last bucket also takes longer contexts)."""

    k: int
    edges: list[int]
    buckets: list[AcceptanceCounts] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.buckets:
            self.buckets = [AcceptanceCounts(self.k) for _ in self.edges[:-1]]

    def add_walk(
        self, tokens: Sequence[int], start: int, proposals: Sequence[Sequence[int]], end: int | None = None
    ) -> None:
        for anchor, a in visited_anchors(tokens, start, proposals, end):
            self.buckets[self.bucket_of(anchor + 2)].count(a)

    def add(self, other: ContextBuckets) -> None:
        for mine, theirs in zip(self.buckets, other.buckets, strict=True):
            mine.add(theirs)

    def bucket_of(self, context: int) -> int:
        return max(0, min(bisect.bisect_right(self.edges, context) - 1, len(self.buckets) - 1))

    def total(self) -> AcceptanceCounts:
        out = AcceptanceCounts(self.k)
        for b in self.buckets:
            out.add(b)
        return out

    def rows(self) -> list[dict[str, Any]]:
        """Per bucket: its range, drafts, accepted per position and mean acceptance length."""
        return [
            {
                "context_from": lo,
                "context_to": hi,
                "num_drafts": b.drafts,
                "accepted_per_pos": list(b.accepted_per_pos),
                "mean_acceptance_length": b.summary()["mean_acceptance_length"] if b.drafts else None,
            }
            for lo, hi, b in zip(self.edges[:-1], self.edges[1:], self.buckets, strict=True)
        ]


def every_anchor(
    tokens: Sequence[int], start: int, proposals: Sequence[Sequence[int]], end: int | None = None
) -> AcceptanceCounts:
    """Every anchor of tokens[start:end], visited or not: the training-time estimate's average. Pure."""
    end = len(tokens) if end is None else end
    counts = AcceptanceCounts(k=len(proposals))
    for anchor in range(start - 1, end - 2):
        counts.count(accepted_at(tokens, proposals, anchor, end))
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
