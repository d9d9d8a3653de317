"""Validation: the draft's losses and accuracies on the held-out split (summarised as its method
says, train.methods), the acceptance a chain draft would get walking the eval conversations
(common.acceptance, as the parity replay walks vLLM's streams), and how often training's
targets are the data's next token."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from eagleflow.common.acceptance import AcceptanceCounts, generated_spans, walk
from eagleflow.train.data import Sample, pack
from eagleflow.train.device import Runtime
from eagleflow.train.draft import verifier_ids
from eagleflow.train.steps import metrics_vector, packed_batch, to_device


@torch.no_grad()
def evaluate(
    model,
    samples: Sequence,
    batch_tokens: int,
    fwd_kwargs: dict[str, Any],
    rt: Runtime,
    keys: list[str],
    summarise: Callable[[dict[str, float]], dict[str, float]],
    read: Callable[[list], list[Sample]] = list,
    walk_steps: int | None = None,
) -> dict[str, float]:
    """Validation metrics over all of `samples` (summed as `keys` name them, then
    `summarise`d: the method's, train.methods); under data parallel each rank takes every
    world_size-th batch and the sums are reduced. `read` turns a batch's items into samples
    with their states (training's refs are read from the shards per batch). `walk_steps`: the
    chain length an EAGLE-3 draft's proposals are walked with (None: the method proposes no
    chain to walk)."""
    model.eval()
    total = torch.zeros(len(keys), dtype=torch.float64, device=rt.device)
    agreement = torch.zeros(2, dtype=torch.float64, device=rt.device)
    k = walk_steps or 0
    walked = AcceptanceCounts(k)
    for i, batch in enumerate(pack(samples, batch_tokens, shuffle_seed=None)):
        if i % rt.world_size != rt.rank:
            continue
        inputs = to_device(packed_batch(read([samples[j] for j in batch]), batch_tokens, rt), rt.device, model)
        with rt.autocast():
            drafts, _, m = model(**inputs, **fwd_kwargs)
            agreement += target_agreement(model, inputs)
        total += metrics_vector(m, keys, rt.device)
        if walk_steps:
            walked.add(walk_batch(model, inputs, drafts))
    model.train()
    agree, counted = rt.sum_(agreement).tolist()
    walk_totals = rt.sum_(
        torch.tensor([walked.drafts, *walked.accepted_per_pos], dtype=torch.float64, device=rt.device)
    )
    walked = AcceptanceCounts(k, int(walk_totals[0]), [int(x) for x in walk_totals[1:].tolist()])
    out = summarise(dict(zip(keys, rt.sum_(total).tolist(), strict=True)))
    return out | {
        "walk_acceptance_length": walked.summary()["mean_acceptance_length"] if walked.drafts else None,
        "target_agreement": agree / counted if counted else None,
    }


def walk_batch(model, batch: dict[str, torch.Tensor], drafts: list[torch.Tensor]) -> AcceptanceCounts:
    """The anchors vLLM would visit on each assistant turn of a packed eval batch, with the
    draft's own chains (speculators' teacher-forced steps, as benchmark.replay uses them), and
    what each accepts: what vLLM's counters would say on the eval split, where the training
    estimate (1 + sum full_acc_k) averages over every anchor instead.

    Shifted alignment (train.data): position t pairs token t+1 with the state at t, so the
    anchor of original position t is position t, and the stream is [x_0] + input_ids."""
    k = len(drafts)
    counts = AcceptanceCounts(k)
    ids, docs, mask = (batch[name][0].tolist() for name in ("input_ids", "document_ids", "loss_mask"))
    steps = [verifier_ids(model, d[0]).tolist() for d in drafts]
    start = 0
    while start < len(ids):
        end = start + 1
        while end < len(ids) and docs[end] == docs[start]:
            end += 1
        tokens = [-1, *ids[start:end]]  # x_0 is never compared: the first anchor is 0 at the earliest
        proposals = [step[start:end] for step in steps]
        for span_start, span_end in generated_spans([0, *mask[start:end]]):
            counts.add(walk(tokens, span_start, proposals, span_end))
        start = end
    return counts


def target_agreement(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """(agreeing, counted) positions of a packed batch: the argmax of the training targets,
    verifier_lm_head(verifier_norm(final state)), against the token that follows in the data,
    where that token is verifier-generated and in the draft vocabulary. On greedy data the two
    are the same token up to rounding of the stored states; targets built without the
    verifier's final norm, or from another layer, agree far less (the parity rule reads it).

    Shifted alignment (train.data): the final state at position t predicts input_ids[t + 1]."""
    targets = model.verifier_lm_head(model.verifier_norm(batch["verifier_last_hidden_states"][0]))
    predicted = verifier_ids(model, targets.argmax(-1))
    ids, docs, mask = batch["input_ids"][0], batch["document_ids"][0], batch["loss_mask"][0].bool()
    following = ids[1:]
    counted = mask[1:] & (docs[1:] == docs[:-1])
    if model.use_draft_vocab:
        counted &= model.t2d[following].bool()
    agree = (predicted[:-1] == following) & counted
    return torch.stack([agree.sum(), counted.sum()]).double()
