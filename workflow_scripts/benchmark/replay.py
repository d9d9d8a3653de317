"""Replay: what the exported draft accepts on the streams vLLM served, computed by eagleflow.

vLLM's EAGLE-3 loop, for one request at temperature 0: the verifier's prefill yields the
first output token; from then on, with the verifier's states known up to position i and the
token x_{i+1} known (the "anchor" i), the draft proposes k tokens in a chain (step 0 from the
verifier's state at i and the embedding of x_{i+1}; step s from its own previous state and
its own previous token), the verifier accepts the longest prefix that matches its greedy
tokens x_{i+2..i+k+1} and adds one token of its own, and the next anchor is i + accepted + 1.

Since greedy outputs are the same with and without the draft, the served stream fixes every
x; what the draft proposes at anchor i depends only on x_{<=i+1} and, down the chain, on its
own earlier proposals, which matter only while they match x. So one teacher-forced pass of
the draft over the whole stream (speculators' test-time-training forward: step s at every
position at once, attending to the verifier-state positions before it and to its own chain)
gives every anchor's chain, and walking the anchors vLLM visits counts what vLLM counts.

The same proposals, averaged over every anchor instead of the visited ones, are the
training-time estimate's measure (train.loop: 1 + sum_k full_acc_k) on the served streams.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from workflow_scripts.train.data import Sample, collate


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
        drafts = max(1, self.drafts)
        accepted = sum(self.accepted_per_pos)
        return {
            "num_drafts": self.drafts,
            "num_accepted_tokens": accepted,
            "mean_acceptance_length": 1.0 + accepted / drafts,
            "acceptance_rate": accepted / (drafts * self.k),
            "per_position_acceptance": [a / drafts for a in self.accepted_per_pos],
        }


def accepted_at(tokens: Sequence[int], proposals: Sequence[Sequence[int]], anchor: int) -> int:
    """How many of the chain proposed at `anchor` match the stream: proposals[s][anchor]
    against tokens[anchor + 2 + s], stopping at the first miss or the stream's end. Pure."""
    n = 0
    for chain in proposals:
        position = anchor + 2 + n
        if position >= len(tokens) or chain[anchor] != tokens[position]:
            break
        n += 1
    return n


def walk(tokens: Sequence[int], prompt_len: int, proposals: Sequence[Sequence[int]]) -> AcceptanceCounts:
    """The anchors vLLM visits on one stream (prompt + output ids) and what each accepts. Pure.

    The first anchor is the prompt's last position (prefill produced tokens[prompt_len]); a
    step that accepts a tokens moves the anchor a + 1 on. A draft is counted while a token is
    still to be generated after the anchor's known one; proposals past the stream's end
    cannot be checked and count as rejected (vLLM checks them against tokens it then drops at
    max_tokens: the last draft of a stream may differ)."""
    counts = AcceptanceCounts(k=len(proposals))
    anchor = prompt_len - 1
    while anchor + 2 < len(tokens):
        a = accepted_at(tokens, proposals, anchor)
        counts.drafts += 1
        for s in range(a):
            counts.accepted_per_pos[s] += 1
        anchor += a + 1
    return counts


def every_anchor(tokens: Sequence[int], prompt_len: int, proposals: Sequence[Sequence[int]]) -> AcceptanceCounts:
    """Every output anchor, visited or not: the training-time estimate's average. Pure."""
    counts = AcceptanceCounts(k=len(proposals))
    for anchor in range(prompt_len - 1, len(tokens) - 2):
        counts.drafts += 1
        for s in range(accepted_at(tokens, proposals, anchor)):
            counts.accepted_per_pos[s] += 1
    return counts


@torch.inference_mode()
def draft_proposals(draft, sample: Sample, k: int, d2t: torch.Tensor | None) -> list[list[int]]:
    """proposals[s][i]: the verifier-vocabulary token the draft proposes at chain step s from
    anchor i of a shifted sample (train.data.shift: position i pairs the verifier's state at i
    with token i+1), for every anchor at once.

    speculators' forward feeds step s the ground-truth tokens rather than the draft's own
    (teacher forcing): where a chain is still alive the two are the same token, and a dead
    chain's later steps are never looked at (accepted_at stops at the first miss).
    `d2t` maps draft-vocabulary indices to verifier ids (target = index + d2t[index]); None
    when the draft predicts over the verifier's whole vocabulary."""
    batch = collate([sample], len(sample))
    steps = draft(
        hidden_states=batch["hidden_states"],
        input_ids=batch["input_ids"],
        document_ids=batch["document_ids"],
        position_ids=batch["position_ids"],
        ttt_steps=k,
    )
    out = []
    for step in steps:
        index = step[0].long()
        out.append((index + d2t[index] if d2t is not None else index).tolist())
    return out
