"""Training data: hidden-state shards, shifted into EAGLE-3 alignment and packed to a token budget.

Alignment (as speculators' shift_batch): at position t the draft sees the verifier state
g_t and the embedding of token x_{t+1}, and learns the verifier's distribution at t+1,
i.e. (x_{t+1}, g_t, y_{t+1}, loss_mask_{t+1}). Packed samples get their own document id,
and positions restart (at 1) for each sample.

The verifier's distribution y comes from its final state, or from shards with the compact
target (hidden_states.target: topk; hidden_states/targets.py) from its top-k logits, whose ids are mapped into the draft
vocabulary here; positions where none of them is in it leave the loss.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from eagleflow.common.fingerprint import stable_fraction
from eagleflow.hidden_states.shard_file import read_shard
from eagleflow.hidden_states.targets import draft_index

# Seed of the learning curve's subsets; fixed, so that subsets are the same in every run.
SUBSET_SEED = 0


@dataclass
class Sample:
    input_ids: torch.Tensor  # [n] int64
    hidden_states: torch.Tensor  # [n, num_aux * hidden]
    verifier_last_hidden_states: torch.Tensor | None  # [n, hidden]; None with the compact target
    loss_mask: torch.Tensor  # [n] bool
    target_ids: torch.Tensor | None = None  # compact target: [n, k] draft-vocabulary indices, -1 outside it
    target_logits: torch.Tensor | None = None  # compact target: [n, k] float32

    def __len__(self) -> int:
        return self.input_ids.shape[0]


def in_training_subset(sample_id: str, fraction: float) -> bool:
    """Whether a training sample is in the `fraction` subset of the training conversations. Pure.

    Whole conversations (a sample id is `<prompt id>#t<turn>`) are in or out, by a stable hash
    of the prompt id: the same on every run, and a smaller subset lies inside a larger one."""
    return fraction >= 1 or stable_fraction(SUBSET_SEED, sample_id.split("#", 1)[0]) < fraction


def trained_on(sample_id: str, num_tokens: int, is_eval: bool, train_fraction: float) -> bool:
    """Whether training reads a sample: at least two tokens (one after the shift), and an eval
    sample or one of the `train_fraction` subset (in_training_subset). Pure."""
    return num_tokens >= 2 and (is_eval or in_training_subset(sample_id, train_fraction))


def load_shards(
    paths: list[str],
    dtype: torch.dtype = torch.float32,
    train_fraction: float = 1.0,
    t2d: torch.Tensor | None = None,
) -> tuple[list[Sample], list[Sample], list[int]]:
    """(train samples, eval samples, aux layer ids) from hidden-state shards, already shifted;
    only the `train_fraction` subset of the training conversations (in_training_subset).
    Shards with the compact target need the draft vocabulary (`t2d`, the vocab map's)."""
    train, evals, layer_ids = [], [], None
    for path in paths:
        meta, samples = read_shard(path, dtype)
        if layer_ids is not None and meta.aux_layer_ids != layer_ids:
            raise ValueError(f"{path}: aux_layer_ids {meta.aux_layer_ids} differ from other shards ({layer_ids})")
        layer_ids = meta.aux_layer_ids
        if samples and samples[0].final is None and t2d is None:
            raise ValueError(f"{path}: the shard keeps top-k logits (hidden_states.target: topk); pass t2d")
        to_draft = draft_index(t2d) if t2d is not None else None
        for s in samples:
            if not trained_on(s.id, len(s.input_ids), s.is_eval, train_fraction):
                continue
            shifted = shift(
                s.input_ids,
                s.aux,
                s.final,
                s.loss_mask,
                None if s.target_ids is None else to_draft[s.target_ids],
                s.target_logits,
            )
            (evals if s.is_eval else train).append(shifted)
    return train, evals, layer_ids


def shift(input_ids, hidden_states, last_hidden_states, loss_mask, target_ids=None, target_logits=None) -> Sample:
    """Drop x_0, g_{n-1}, y_0, l_0 so that position t pairs (x_{t+1}, g_t, y_{t+1}, l_{t+1}).
    With the compact target, positions none of whose top-k ids is in the draft vocabulary
    have no target: they leave the loss. Pure."""
    if target_ids is None:
        return Sample(input_ids[1:], hidden_states[:-1], last_hidden_states[1:], loss_mask[1:])
    ids = target_ids[1:]
    mask = loss_mask[1:] & (ids >= 0).any(dim=-1)
    return Sample(input_ids[1:], hidden_states[:-1], None, mask, ids, target_logits[1:])


def pack(samples: list[Sample], batch_tokens: int, shuffle_seed: int | None) -> list[list[int]]:
    """Greedy first-fit packing of sample indices into batches of at most `batch_tokens`. Pure."""
    order = list(range(len(samples)))
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(order)
    batches, current, used = [], [], 0
    for i in order:
        n = min(len(samples[i]), batch_tokens)
        if current and used + n > batch_tokens:
            batches.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        batches.append(current)
    return batches


def collate(samples: list[Sample], batch_tokens: int) -> dict[str, torch.Tensor]:
    """One packed [1, T] batch in the layout Eagle3DraftModel.forward takes (the compact
    target's top-k pairs as they are: train.loop.to_device makes the dense targets)."""
    cut = [min(len(s), batch_tokens) for s in samples]

    def cat(field: str) -> torch.Tensor:
        return torch.cat([getattr(s, field)[:n] for s, n in zip(samples, cut, strict=True)]).unsqueeze(0)

    compact = samples[0].target_ids is not None
    targets = ("target_ids", "target_logits") if compact else ("verifier_last_hidden_states",)
    return {
        "input_ids": cat("input_ids"),
        "hidden_states": cat("hidden_states"),
        **{name: cat(name) for name in targets},
        "loss_mask": cat("loss_mask"),
        "document_ids": torch.cat([torch.full((n,), d, dtype=torch.long) for d, n in enumerate(cut)]).unsqueeze(0),
        "position_ids": torch.cat([torch.arange(1, n + 1, dtype=torch.long) for n in cut]).unsqueeze(0),
    }
