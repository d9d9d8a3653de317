"""Validation: the draft's losses and accuracies on the held-out split (summarised as its method
says, train.methods), the acceptance the draft would get walking the eval conversations
(common.acceptance over the method's proposals, as the parity replay walks vLLM's streams),
and how often training's targets are the data's next token."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from eagleflow.common.acceptance import AcceptanceCounts, generated_spans
from eagleflow.common.acceptance import walk as walk_stream
from eagleflow.train.config import TrainConfig
from eagleflow.train.data import Sample, pack
from eagleflow.train.device import Runtime
from eagleflow.train.draft import verifier_ids
from eagleflow.train.methods import DraftMethod
from eagleflow.train.steps import metrics_vector, packed_batch, to_device


@dataclass(frozen=True)
class Walk:
    """How the evaluation walks a method's drafts: its proposals at every anchor
    (train.proposals), the tokens of a draft step, whether its samples are shifted, and
    whether the eval forward itself returns them (EAGLE-3's chains, on the packed batch as
    the step runs it: no second forward, and the batch shape flex attention needs on a GPU)."""

    propose: Callable[[Any, Sample, int], list[list[int]]]
    k: int
    shifted: bool
    from_forward: bool

    @classmethod
    def of(cls, method: DraftMethod, cfg: TrainConfig) -> Walk | None:
        """None where the method's drafting is not replayed."""
        if not method.propose:
            return None
        return cls(method.propose, method.draft_tokens(cfg), method.shifted, method.chain)


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
    walk: Walk | None = None,
) -> dict[str, float]:
    """Validation metrics over all of `samples` (summed as `keys` name them, then
    `summarise`d: the method's, train.methods); under data parallel each rank takes every
    world_size-th batch and the sums are reduced. `read` turns a batch's items into samples
    with their states (training's refs are read from the shards per batch). `walk`: how the
    draft's proposals are walked over each sample (None: the method's drafting is not
    replayed)."""
    model.eval()
    total = torch.zeros(len(keys), dtype=torch.float64, device=rt.device)
    agreement = torch.zeros(2, dtype=torch.float64, device=rt.device)
    k = walk.k if walk else 0
    walked = AcceptanceCounts(k)
    for i, batch in enumerate(pack(samples, batch_tokens, shuffle_seed=None)):
        if i % rt.world_size != rt.rank:
            continue
        read_back = read([samples[j] for j in batch])
        inputs = to_device(packed_batch(read_back, batch_tokens, rt), rt.device, model)
        with rt.autocast():
            drafts, _, m = model(**inputs, **fwd_kwargs)
            agreement += target_agreement(model, inputs)
            if walk and walk.from_forward:
                walked.add(walk_batch(model, inputs, drafts))
            elif walk:
                for sample in read_back:
                    walked.add(walk_sample(model, to_device_sample(sample, rt.device), walk))
        total += metrics_vector(m, keys, rt.device)
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
    """walk_sample for each sample of a packed, shifted eval batch, with the chains the eval
    forward returned (speculators' teacher-forced steps, as train.proposals.chain_proposals
    computes them one sample at a time)."""
    counts = AcceptanceCounts(len(drafts))
    ids, docs, mask = (batch[name][0].tolist() for name in ("input_ids", "document_ids", "loss_mask"))
    steps = [verifier_ids(model, d[0]).tolist() for d in drafts]
    start = 0
    while start < len(ids):
        end = start + 1
        while end < len(ids) and docs[end] == docs[start]:
            end += 1
        counts.add(walk_proposals(ids[start:end], mask[start:end], [step[start:end] for step in steps], True))
        start = end
    return counts


def walk_sample(model, sample: Sample, walk: Walk) -> AcceptanceCounts:
    """The anchors vLLM would visit on each assistant turn of an eval sample, with the draft's
    own proposals (train.proposals, as the parity replay walks vLLM's streams), and what each
    accepts: what vLLM's counters would say on the eval split, where the training estimate
    averages over every anchor instead.

    A shifted sample's position t holds x_{t+1} (train.data.shift), so the stream is x_0, never
    compared, then its tokens; an unshifted one's position t holds x_t."""
    proposals = walk.propose(model, sample, walk.k)
    return walk_proposals(sample.input_ids.tolist(), sample.loss_mask.int().tolist(), proposals, walk.shifted)


def walk_proposals(ids: list[int], mask: list[int], proposals: list[list[int]], shifted: bool) -> AcceptanceCounts:
    """What vLLM's walk accepts over each assistant turn (loss-mask run) of one sample's
    tokens, with the draft's proposals at each of its anchors. Pure."""
    tokens, mask = ([-1, *ids], [0, *mask]) if shifted else (ids, mask)
    counts = AcceptanceCounts(len(proposals))
    for span_start, span_end in generated_spans(mask):
        counts.add(walk_stream(tokens, span_start, proposals, span_end))
    return counts


def to_device_sample(sample: Sample, device: torch.device) -> Sample:
    return Sample(*(None if t is None else t.to(device) for t in dataclasses.astuple(sample)))


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
