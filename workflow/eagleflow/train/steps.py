"""One optimizer step, and the schedule around it: the learning rate at a step, the steps in
an epoch, moving a batch to the device."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from eagleflow.hidden_states.targets import dense_targets
from eagleflow.train.data import Sample, collate
from eagleflow.train.device import Runtime

# train.lr_schedule: the decay after the warmup.
LR_SCHEDULES = ("linear", "cosine")


def lr_at(
    step: int, total: int, base_lr: float, warmup: int, schedule: str = "linear", min_ratio: float = 0.1
) -> float:
    """The learning rate of step `step` of `total`: linear warmup over `warmup` steps, then
    `schedule`: "linear" decays to 0 at `total` (speculators' default), "cosine" to `min_ratio`
    * base_lr. Pure."""
    if step < warmup:
        return base_lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "linear":
        return base_lr * (1 - progress)
    if schedule == "cosine":
        return base_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
    raise ValueError(f"train.lr_schedule: {schedule!r} is none of {', '.join(LR_SCHEDULES)}")


def steps_in(num_batches: int, world_size: int) -> int:
    return -(-num_batches // world_size)


def metrics_vector(metrics: dict[str, torch.Tensor] | None, keys: list[str], device: torch.device) -> torch.Tensor:
    if metrics is None:  # this rank's batch in this step was a stand-in
        return torch.zeros(len(keys), dtype=torch.float64, device=device)
    return torch.stack(
        [torch.ones((), device=device) if k == "num_batches" else metrics[k].detach().float().reshape(()) for k in keys]
    ).double()


# What a padding position holds: a document of its own (-1, speculators' padding document,
# which attends only to itself) and no loss; every other field zeros.
PAD_VALUES = {"document_ids": -1}


def pad_to_length(batch: dict[str, torch.Tensor], length: int) -> dict[str, torch.Tensor]:
    """A collated [1, T] batch lengthened to `length` tokens (Runtime.step_length; 0 or T:
    as it is) with padding that carries no loss and that no evaluation walks (loss_mask 0).
    Pure."""
    extra = length - batch["input_ids"].shape[1]
    if extra <= 0:
        return batch
    return {
        name: torch.cat([t, t.new_full((1, extra, *t.shape[2:]), PAD_VALUES.get(name, 0))], dim=1)
        for name, t in batch.items()
    }


def packed_batch(samples: list[Sample], batch_tokens: int, rt: Runtime) -> dict[str, torch.Tensor]:
    """`samples` collated into one [1, T] batch as this runtime steps on it: padded to
    Runtime.step_length (one length on CUDA, in whole flex-attention blocks)."""
    return pad_to_length(collate(samples, batch_tokens), rt.step_length(batch_tokens))


def to_device(batch: dict[str, torch.Tensor], device: torch.device, model=None) -> dict[str, torch.Tensor]:
    """A collated batch on `device`, as the draft's forward takes it: the compact target's
    top-k pairs become dense logits on `model`'s draft vocabulary there (the host sends k
    pairs per token, not a row of the vocabulary), in the final state's place
    (train.draft.take_precomputed_targets)."""
    out = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    if "target_ids" in out:
        vocab = model.lm_head.weight.shape[0]
        out["verifier_last_hidden_states"] = dense_targets(out.pop("target_ids"), out.pop("target_logits"), vocab)
    return out


def train_step(
    model,
    params,
    optimizer,
    batch,
    rt: Runtime,
    fwd_kwargs,
    *,
    lr: float,
    loss_scale: float,
    grad_clip: float,
    keys,
    counted: bool = True,
):
    """One optimizer step on this rank's `batch`, through `model` as Runtime.stepped gives it
    (across ranks, DDP averages the gradients in the backward pass). `counted` False: a
    stand-in batch of a rank the step has none for, whose loss is scaled to nothing and whose
    metrics count nothing; it runs so that every rank takes part in DDP's all-reduce.

    Returns (grad_norm, summed metrics vector over all ranks) as device tensors: nothing here
    waits for the device.
    """
    for group in optimizer.param_groups:
        group["lr"] = lr
    with rt.autocast():
        _, loss, metrics = model(**to_device(batch, rt.device, getattr(model, "module", model)), **fwd_kwargs)
    (loss * (loss_scale if counted else 0.0)).backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, rt.sum_(metrics_vector(metrics if counted else None, keys, rt.device))


@dataclass
class Window:
    """Train metrics summed since the last train row, with the tokens and training wall time
    they took (validation time excluded)."""

    sums: torch.Tensor
    tokens: int
    started: float

    @classmethod
    def restore(cls, saved: dict[str, float], keys: list[str], device: torch.device) -> Window:
        sums = torch.tensor([saved.get(k, 0.0) for k in keys], dtype=torch.float64, device=device)
        return cls(sums, int(saved.get("tokens", 0)), time.monotonic())

    def saved(self, keys: list[str]) -> dict[str, float]:
        return {**dict(zip(keys, self.sums.tolist(), strict=True)), "tokens": self.tokens}

    def reset(self) -> None:
        self.sums.zero_()
        self.tokens, self.started = 0, time.monotonic()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        paused_at = time.monotonic()
        yield
        self.started += time.monotonic() - paused_at
