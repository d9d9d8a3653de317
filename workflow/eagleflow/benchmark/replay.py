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

import torch

from eagleflow.train.data import Sample, collate
from eagleflow.train.draft import verifier_ids


@torch.inference_mode()
def draft_proposals(draft, sample: Sample, k: int) -> list[list[int]]:
    """proposals[s][i]: the verifier-vocabulary token the draft proposes at chain step s from
    anchor i of a shifted sample (train.data.shift: position i pairs the verifier's state at i
    with token i+1), for every anchor at once.

    speculators' forward feeds step s the ground-truth tokens rather than the draft's own
    (teacher forcing): where a chain is still alive the two are the same token, and a dead
    chain's later steps are never looked at (common.acceptance.accepted_at stops at the
    first miss). The draft's own d2t maps its predictions to verifier ids, as vLLM's does."""
    batch = collate([sample], len(sample))
    steps = draft(
        hidden_states=batch["hidden_states"],
        input_ids=batch["input_ids"],
        document_ids=batch["document_ids"],
        position_ids=batch["position_ids"],
        ttt_steps=k,
    )
    return [verifier_ids(draft, step[0]).tolist() for step in steps]
