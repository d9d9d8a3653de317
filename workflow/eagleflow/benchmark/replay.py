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


@torch.inference_mode()
def block_proposals(draft, sample: Sample, k: int) -> list[list[int]]:
    """proposals[s][i] as draft_proposals gives them, for a block drafter (DFlash) on an
    unshifted sample (position t: token x_t, the verifier's state at t). At anchor i vLLM knows
    the states up to i and the bonus token x_{i+1}: the draft's block is anchored at i + 1 (its
    token x_{i+1}, attending to the states before it) and its slot s + 1 proposes x_{i+2+s}.

    Every anchor at once: speculators' own block forward (_backbone_forward) with an anchor at
    every position, the sample padded by a block (positions after an anchor are never its
    context) so that the last anchors' blocks fit."""
    import speculators.models.dflash.core as dflash_core

    n, block = len(sample), draft.block_size
    pad = block

    def every_position(loss_mask, num_anchors, block_size):
        return torch.arange(n, device=loss_mask.device), torch.ones(n, dtype=torch.bool, device=loss_mask.device)

    batch = collate([sample], n)
    padded = {
        name: torch.cat([t, t.new_zeros((1, pad, *t.shape[2:]))], dim=1)
        for name, t in batch.items()
        if name in ("input_ids", "hidden_states", "verifier_last_hidden_states", "loss_mask")
    }
    padded["document_ids"] = torch.zeros((1, n + pad), dtype=torch.long)
    padded["position_ids"] = torch.arange(n + pad).unsqueeze(0)
    chosen = dflash_core.select_anchors
    dflash_core.select_anchors = every_position  # the module's own name: _build_attention_mask reads it
    try:
        _, logits, _, _, _ = draft._backbone_forward(**padded, max_anchors=n)
    finally:
        dflash_core.select_anchors = chosen
    predicted = verifier_ids(draft, logits[0].argmax(-1)).view(n, block).tolist()
    # Anchor i is the block at i + 1; the last position anchors nothing vLLM could check.
    return [[predicted[i + 1][s + 1] if i + 1 < n else -1 for i in range(n)] for s in range(k)]


# The draft methods whose drafting the replay reproduces (train.methods): whether it reads the
# streams shifted (EAGLE-3, as training's shift) or every position as it is (DFlash's blocks),
# and what proposes at every anchor.
REPLAYS = {"eagle3": (True, draft_proposals), "dflash": (False, block_proposals)}
