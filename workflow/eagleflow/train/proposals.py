"""What a draft proposes at every anchor of a token stream, computed at once, per draft method:
the parity replay walks them over the streams vLLM served (benchmark.parity), and training's
evaluation over the eval split (train.evaluation).

vLLM's loop, for one request at temperature 0: the verifier's prefill yields the first output
token; from then on, with the verifier's states known up to position i and the token x_{i+1}
known (the "anchor" i), the draft proposes k tokens, the verifier accepts the longest prefix
that matches its greedy tokens x_{i+2..i+k+1} and adds one token of its own, and the next
anchor is i + accepted + 1 (common.acceptance walks it). How the k tokens are proposed is the
method's:

- EAGLE-3, a chain: step 0 from the verifier's state at i and the embedding of x_{i+1}; step s
  from its own previous state and its own previous token.
- P-EAGLE, parallel drafting: one forward over x_{i+1} with the state at i, and k - 1 mask
  tokens with the learned mask state after it.
- DFlash, a block: one forward over a block anchored at i + 1 (x_{i+1}, then mask tokens)
  attending to the verifier's states before it.

Since greedy outputs are the same with and without the draft, the served stream fixes every
x, and what the draft proposes at anchor i depends only on x_{<=i+1} and the states up to i
(and, down a chain, on its own earlier proposals, which matter only while they match x). So
one pass of the method's own training forward over the whole stream, with every position an
anchor, gives every anchor's proposals: `proposals[s][i]` is the verifier-vocabulary token
proposed at step s from anchor i. The draft's own d2t maps its predictions to verifier ids, as
vLLM's does. Each forward is speculators' own; this module only chooses the anchors.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from eagleflow.train.data import Sample, collate
from eagleflow.train.draft import verifier_ids
from eagleflow.train.steps import to_device

# Anchors per forward of the parallel and block drafters: their forward grows with anchors
# times draft tokens, and a dense SDPA mask with its square.
ANCHORS_PER_FORWARD = 256


@torch.inference_mode()
def chain_proposals(draft, sample: Sample, k: int) -> list[list[int]]:
    """EAGLE-3's chains on a shifted sample (train.data.shift: position i pairs the verifier's
    state at i with token i+1), for every anchor at once.

    speculators' test-time-training forward feeds step s the ground-truth tokens rather than
    the draft's own (teacher forcing): where a chain is still alive the two are the same
    token, and a dead chain's later steps are never looked at (common.acceptance.accepted_at
    stops at the first miss)."""
    batch = to_device(collate([sample], len(sample)), sample.input_ids.device, draft)
    steps = draft(
        hidden_states=batch["hidden_states"],
        input_ids=batch["input_ids"],
        document_ids=batch["document_ids"],
        position_ids=batch["position_ids"],
        ttt_steps=k,
    )
    return [verifier_ids(draft, step[0]).tolist() for step in steps]


@torch.inference_mode()
def parallel_proposals(draft, sample: Sample, k: int) -> list[list[int]]:
    """P-EAGLE's parallel drafts on a shifted sample. speculators' training forward takes its
    rows from COD sampling (depth 0 at every position, depth d at sampled anchors); here depth 0
    is every position (the context every draft attends to) and depth 1..k-1 every anchor of a
    chunk, so that row (anchor i, depth d) is the draft's position i + d, as vLLM's mask-token
    slots are."""
    import speculators.models.peagle.core as peagle_core
    from speculators.losses import resolve_loss_config

    # The forward also computes its loss, which proposals never read: the eager one runs anywhere.
    loss_config = resolve_loss_config("kl_div", "eager")
    n = len(sample)
    padded = padded_batch(draft, sample, k - 1)
    predicted = [[0] * n for _ in range(k)]
    for lo, hi in anchor_chunks(n):

        def chunk_rows(seq_length, loss_mask, num_depths, lo=lo, hi=hi, **_):
            device = loss_mask.device
            chunk = torch.arange(lo, hi, device=device)
            anchor_pos = torch.cat([torch.arange(n, device=device), chunk.repeat(num_depths - 1)])
            depth = torch.cat(
                [
                    torch.zeros(n, dtype=torch.long, device=device),
                    torch.arange(1, num_depths, device=device).repeat_interleave(hi - lo),
                ]
            )
            return anchor_pos, depth

        with replaced(peagle_core, "generate_cod_sample_indices", chunk_rows), lm_head_outputs(draft) as logits:
            draft(**padded, num_depths=k, loss_config=loss_config)
        ids = verifier_ids(draft, logits[0][0].argmax(-1)).tolist()
        if lo == 0:
            predicted[0] = ids[:n]
        for d in range(1, k):
            start = n + (d - 1) * (hi - lo)
            predicted[d][lo:hi] = ids[start : start + hi - lo]
    return predicted


@torch.inference_mode()
def block_proposals(draft, sample: Sample, k: int) -> list[list[int]]:
    """DFlash's blocks on an unshifted sample (position t: token x_t, the verifier's state at t).
    At anchor i vLLM knows the states up to i and the bonus token x_{i+1}: the draft's block is
    anchored at i + 1 (its token x_{i+1}, attending to the states before it) and its slot s + 1
    proposes x_{i+2+s}. speculators' block forward (_backbone_forward) samples its anchors;
    here every position of a chunk is one, the sample padded by a block (positions after an
    anchor are never its context) so that the last anchors' blocks fit."""
    import speculators.models.dflash.core as dflash_core

    n, block = len(sample), draft.block_size
    padded = padded_batch(draft, sample, block)
    predicted: list[list[int]] = []
    for lo, hi in anchor_chunks(n):

        def chunk_anchors(loss_mask, num_anchors, block_size, lo=lo, hi=hi):
            device = loss_mask.device
            return torch.arange(lo, hi, device=device), torch.ones(hi - lo, dtype=torch.bool, device=device)

        with replaced(dflash_core, "select_anchors", chunk_anchors):
            _, logits, _, _, _ = draft._backbone_forward(**padded, max_anchors=hi - lo)
        predicted += verifier_ids(draft, logits[0].argmax(-1)).view(hi - lo, block).tolist()
    # Anchor i is the block at i + 1; the last position anchors nothing vLLM could check.
    return [[predicted[i + 1][s + 1] if i + 1 < n else -1 for i in range(n)] for s in range(k)]


def anchor_chunks(n: int) -> list[tuple[int, int]]:
    return [(lo, min(n, lo + ANCHORS_PER_FORWARD)) for lo in range(0, n, ANCHORS_PER_FORWARD)]


def padded_batch(draft, sample: Sample, pad: int) -> dict[str, torch.Tensor]:
    """One sample as the draft's training forward takes it (train.steps.to_device: the compact
    target's top-k pairs become dense logits in the final state's place), `pad` positions
    longer (one document), for drafted positions past its end."""
    n = len(sample)
    batch = to_device(collate([sample], n), sample.input_ids.device, draft)
    out = {
        name: torch.cat([batch[name], batch[name].new_zeros((1, pad, *batch[name].shape[2:]))], dim=1)
        for name in ("input_ids", "hidden_states", "verifier_last_hidden_states", "loss_mask")
    }
    device = batch["input_ids"].device  # training's evaluation walks on the training device
    out["document_ids"] = torch.zeros((1, n + pad), dtype=torch.long, device=device)
    out["position_ids"] = torch.arange(1, n + pad + 1, device=device).unsqueeze(0)
    return out


@contextmanager
def replaced(module, name: str, rows):
    """speculators' function that picks a training forward's rows (P-EAGLE's COD sampling,
    DFlash's anchors), replaced by `rows` for the duration: the module's own name, which its
    forward reads."""
    chosen = getattr(module, name)
    setattr(module, name, rows)
    try:
        yield
    finally:
        setattr(module, name, chosen)


@contextmanager
def lm_head_outputs(draft):
    """The logits at the draft's lm_head while the block runs: P-EAGLE's training forward
    returns none."""
    outputs: list[torch.Tensor] = []
    hook = draft.lm_head.register_forward_hook(lambda _module, _inputs, out: outputs.append(out))
    try:
        yield outputs
    finally:
        hook.remove()
