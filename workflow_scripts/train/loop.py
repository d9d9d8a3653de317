"""The training loop, top to bottom: data, model, optimizer, resume, step, eval, checkpoint, export.

Validation runs on the held-out split every `eval_every` steps and at the end of every
epoch; the draft exported is the one with the lowest validation loss. The estimated
acceptance length of a chain draft is 1 + sum_k full_acc_k, where full_acc_k is the
fraction of positions whose first k+1 draft tokens were all correct.

Data parallel: under torchrun every rank runs this same loop. A step consumes `world_size`
consecutive batches of the epoch's packing, one per rank; each rank scales its loss by
1 / (batches in this step) and the gradients are summed across ranks, which is exactly
gradient accumulation over those batches. Metrics are summed the same way; only rank 0
writes metrics, checkpoints and the draft. With one process it is the plain loop.

Resume: every `checkpoint_every` steps the full training state is checkpointed under
`checkpoint_dir/<fingerprint>/`; a rerun with the same config, inputs and code continues
from the newest one and produces the same metrics rows and weights as an uninterrupted run.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import shutil
import signal
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from tqdm import tqdm

from workflow_scripts.common.atomic import atomic_path, write_jsonl
from workflow_scripts.common.fingerprint import code_fingerprint
from workflow_scripts.train.checkpoint import (
    TrainState,
    latest_checkpoint,
    restore,
    save_checkpoint,
    trainable_state,
    training_fingerprint,
)
from workflow_scripts.train.data import collate, load_shards, pack
from workflow_scripts.train.draft import build_draft, export_draft

log = logging.getLogger(__name__)

# Fault injection for the resume tests: "STEP" or "STEP:SIGNAME" sends the signal (default
# SIGKILL) to this process once step STEP (and its checkpoint, if due) is done.
KILL_AT_STEP_ENV = "EAGLEFLOW_TRAIN_KILL_AT_STEP"


def lr_at(step: int, total: int, base_lr: float, warmup: int, min_ratio: float = 0.1) -> float:
    """Linear warmup, then cosine decay to `min_ratio` * base_lr. Pure."""
    if step < warmup:
        return base_lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return base_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def metric_keys(ttt_steps: int) -> list[str]:
    """The per-batch {name_sum, name_total} metrics that summarise reads, in a fixed order
    (every rank reduces the same vector). `num_batches` counts the batches summed."""
    keys = ["num_batches", "loss_sum"]
    for k in range(ttt_steps):
        keys += [f"{n}_{k}_{t}" for n in ("loss", "full_acc", "cond_acc") for t in ("sum", "total")]
    return keys


def summarise(totals: dict[str, float], ttt_steps: int) -> dict[str, float]:
    """Means from summed metrics (see metric_keys): loss per batch, accuracies per position. Pure."""

    def ratio(name):
        t = totals[f"{name}_total"]
        return totals[f"{name}_sum"] / t if t else 0.0

    out = {"loss": totals["loss_sum"] / max(1.0, totals["num_batches"])}
    for k in range(ttt_steps):
        out[f"loss_{k}"] = ratio(f"loss_{k}")
        out[f"full_acc_{k}"] = ratio(f"full_acc_{k}")
        out[f"cond_acc_{k}"] = ratio(f"cond_acc_{k}")
    out["estimated_acceptance_length"] = 1.0 + sum(out[f"full_acc_{k}"] for k in range(ttt_steps))
    return out


def steps_in(num_batches: int, world_size: int) -> int:
    return -(-num_batches // world_size)


# --- device, attention and loss --------------------------------------------------------------


@dataclass(frozen=True)
class Runtime:
    rank: int
    world_size: int
    device: torch.device
    attn_impl: str
    loss_implementation: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def autocast(self):
        # bf16 compute on GPUs, float32 master weights; CPUs without bf16 units take slow paths in bf16.
        return torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda" else nullcontext()

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t


def resolve_impls(attn_impl: str, loss_implementation: str, cuda: bool, triton: bool) -> tuple[str, str]:
    """("auto" resolved) attention and loss implementations for the device. Pure.

    Flex attention has no CPU backward and the fused loss is a Triton kernel, so on CPU
    "auto" means sdpa and the eager loss; asking for them explicitly there is an error.
    """
    attn = attn_impl if attn_impl != "auto" else ("simple_flex_attention" if cuda else "sdpa")
    loss = loss_implementation if loss_implementation != "auto" else ("fused" if cuda and triton else "eager")
    if attn == "simple_flex_attention" and not cuda:
        raise ValueError(
            "train.attn_impl: simple_flex_attention needs CUDA (flex "
            "attention has no CPU backward); use auto, sdpa or eager"
        )
    if loss == "fused" and not (cuda and triton):
        raise ValueError("train.loss_implementation: fused needs CUDA and Triton; use auto or eager")
    return attn, loss


def init_runtime(cfg: dict[str, Any]) -> Runtime:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    cuda = torch.cuda.is_available()
    if cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if cuda else "gloo")
    attn, loss = resolve_impls(
        cfg["attn_impl"], cfg["loss_implementation"], cuda, importlib.util.find_spec("triton") is not None
    )
    return Runtime(rank, world_size, device, attn, loss)


# --- steps -----------------------------------------------------------------------------------


def metrics_vector(metrics: dict[str, torch.Tensor] | None, keys: list[str], device: torch.device) -> torch.Tensor:
    if metrics is None:  # this rank had no batch in this step
        return torch.zeros(len(keys), dtype=torch.float64, device=device)
    return torch.stack(
        [torch.ones((), device=device) if k == "num_batches" else metrics[k].detach().float().reshape(()) for k in keys]
    ).double()


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def train_step(
    model, params, optimizer, batch, rt: Runtime, fwd_kwargs, *, lr: float, loss_scale: float, grad_clip: float, keys
):
    """One optimizer step on this rank's `batch` (None: no batch for this rank in this step).

    Returns (grad_norm, summed metrics vector over all ranks) as device tensors: nothing here
    waits for the device.
    """
    for group in optimizer.param_groups:
        group["lr"] = lr
    metrics = None
    if batch is not None:
        with rt.autocast():
            _, loss, metrics = model(**to_device(batch, rt.device), **fwd_kwargs)
        (loss * loss_scale).backward()
    if rt.world_size > 1:
        all_reduce_grads(params)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, rt.sum_(metrics_vector(metrics, keys, rt.device))


def all_reduce_grads(params: list[torch.nn.Parameter]) -> None:
    """Sum gradients across ranks, in place (a rank without a batch adds zeros). One
    asynchronous all-reduce per parameter: no flat copy of a large draft's gradients."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    handles = [dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, async_op=True) for p in params]
    for h in handles:
        h.wait()


@torch.no_grad()
def evaluate(
    model, samples, batch_tokens: int, fwd_kwargs: dict[str, Any], rt: Runtime, keys: list[str]
) -> dict[str, float]:
    """Validation metrics over all of `samples`; under data parallel each rank takes every
    world_size-th batch and the sums are reduced."""
    model.eval()
    total = torch.zeros(len(keys), dtype=torch.float64, device=rt.device)
    for i, batch in enumerate(pack(samples, batch_tokens, shuffle_seed=None)):
        if i % rt.world_size != rt.rank:
            continue
        with rt.autocast():
            _, _, m = model(**to_device(collate([samples[j] for j in batch], batch_tokens), rt.device), **fwd_kwargs)
        total += metrics_vector(m, keys, rt.device)
    model.train()
    return summarise(dict(zip(keys, rt.sum_(total).tolist(), strict=True)), fwd_kwargs["ttt_steps"])


def kill_hook() -> tuple[int, int] | None:
    spec = os.environ.get(KILL_AT_STEP_ENV)
    if not spec:
        return None
    step, _, name = spec.partition(":")
    return int(step), int(getattr(signal, name or "SIGKILL"))


# --- the loop --------------------------------------------------------------------------------


def run_train(
    shards: list[str],
    vocab_map: str,
    verifier_dir: str,
    draft_out: str,
    metrics_out: str,
    *,
    index: str,
    checkpoint_dir: str,
    serve_verifier_path: str,
    cfg: dict[str, Any],
    threads: int,
) -> None:
    torch.set_num_threads(threads)
    rt = init_runtime(cfg)
    try:
        _train(
            shards,
            vocab_map,
            verifier_dir,
            draft_out,
            metrics_out,
            index,
            Path(checkpoint_dir),
            serve_verifier_path,
            cfg,
            rt,
        )
    finally:
        if rt.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()


def _train(
    shards,
    vocab_map,
    verifier_dir,
    draft_out,
    metrics_out,
    index,
    checkpoint_root: Path,
    serve_verifier_path,
    cfg,
    rt: Runtime,
):
    torch.manual_seed(cfg["seed"])
    fingerprint = training_fingerprint(cfg, index, vocab_map, shards, code_fingerprint("workflow_scripts.train.loop"))
    ckpt_dir = checkpoint_root / fingerprint
    train, evals, aux_layer_ids = load_shards(shards)
    if not train or not evals:
        raise ValueError(
            f"hidden-state shards hold {len(train)} train and {len(evals)} eval samples; both must be non-empty"
        )
    vocab = load_file(vocab_map)
    model = build_draft(
        verifier_dir,
        vocab["d2t"],
        vocab["t2d"],
        num_layers=cfg["num_layers"],
        ttt_steps=cfg["ttt_steps"],
        aux_layer_ids=aux_layer_ids,
        attn_impl=rt.attn_impl,
        sliding_window=cfg.get("sliding_window"),
    ).to(rt.device)
    from speculators.losses import resolve_loss_config

    ttt = cfg["ttt_steps"]
    fwd_kwargs = {
        "ttt_steps": ttt,
        "ttt_step_loss_decay": cfg["ttt_step_loss_decay"],
        "loss_config": resolve_loss_config(cfg["loss"], rt.loss_implementation),
    }
    keys = metric_keys(ttt)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg["lr"], betas=(0.9, 0.95), weight_decay=cfg["weight_decay"])
    # The packing of every epoch is fixed up front (a pure function of the seed), so the
    # schedule knows the exact number of steps and a resumed run sees the same batches.
    epochs = [pack(train, cfg["batch_tokens"], shuffle_seed=cfg["seed"] * 1000 + e) for e in range(cfg["epochs"])]
    total_steps = sum(steps_in(len(b), rt.world_size) for b in epochs)
    checkpoint_every, keep = cfg.get("checkpoint_every", 0), cfg.get("keep_checkpoints", 2)
    if rt.is_main:
        log.info(
            "draft: %.2fM trainable params; %d train / %d eval "
            "samples (%d / %d tokens); %d steps on %d %s process(es); "
            "attention %s, loss %s; checkpoints in %s",
            sum(p.numel() for p in params) / 1e6,
            len(train),
            len(evals),
            sum(map(len, train)),
            sum(map(len, evals)),
            total_steps,
            rt.world_size,
            rt.device.type,
            rt.attn_impl,
            rt.loss_implementation,
            ckpt_dir,
        )
        others = (
            [p.name for p in checkpoint_root.iterdir() if p.is_dir() and p.name != fingerprint]
            if checkpoint_root.is_dir()
            else []
        )
        if others:
            log.info(
                "not resuming checkpoints of other configs/inputs/code in %s: %s",
                checkpoint_root,
                ", ".join(sorted(others)),
            )

    state, best = TrainState(), None
    ckpt = latest_checkpoint(ckpt_dir, fingerprint)
    if ckpt is not None:
        restore(ckpt, model, optimizer)
        state, best = ckpt.state, ckpt.best
        if rt.is_main:
            log.info(
                "resuming from step %d of %d (%s; epoch %d, batch %d; best eval loss %s)",
                state.step,
                total_steps,
                ckpt.path,
                state.epoch,
                state.batch_index,
                f"{state.best_loss:.4f}" if best is not None else "none yet",
            )
    elif rt.is_main:
        log.info("starting at step 0 of %d (no checkpoint in %s)", total_steps, ckpt_dir)
    if rt.world_size > 1:
        for p in params:  # identical seeds give identical weights; make it explicit
            dist.broadcast(p.data, src=0)
    if not rt.is_main:
        best = None  # only rank 0 writes the draft

    window = torch.tensor([state.window.get(k, 0.0) for k in keys], dtype=torch.float64, device=rt.device)
    window_tokens, window_start = state.window.get("tokens", 0), time.monotonic()
    hook = kill_hook()

    def validate(epoch):
        nonlocal best
        val = evaluate(model, evals, cfg["batch_tokens"], fwd_kwargs, rt, keys)
        state.rows.append({"step": state.step, "epoch": epoch, "split": "eval", **val})
        if val["loss"] < state.best_loss:
            state.best_loss, state.best_step = val["loss"], state.step
            if rt.is_main:
                best = {k: v.detach().clone() for k, v in trainable_state(model).items()}
        return val

    model.train()
    bar = tqdm(
        total=total_steps, initial=state.step, desc="train", unit="step", mininterval=2.0, disable=not rt.is_main
    )
    grad_norm = torch.zeros(())
    for epoch in range(state.epoch, len(epochs)):
        batches = epochs[epoch]
        n_steps = steps_in(len(batches), rt.world_size)
        for j in range(state.batch_index if epoch == state.epoch else 0, n_steps):
            step_batches = batches[j * rt.world_size : (j + 1) * rt.world_size]
            mine = step_batches[rt.rank] if rt.rank < len(step_batches) else None
            batch = collate([train[i] for i in mine], cfg["batch_tokens"]) if mine is not None else None
            lr = lr_at(state.step, total_steps, cfg["lr"], cfg["warmup_steps"])
            grad_norm, reduced = train_step(
                model,
                params,
                optimizer,
                batch,
                rt,
                fwd_kwargs,
                lr=lr,
                loss_scale=1.0 / len(step_batches),
                grad_clip=cfg["grad_clip"],
                keys=keys,
            )
            window += reduced
            window_tokens += sum(min(len(train[i]), cfg["batch_tokens"]) for b in step_batches for i in b)
            state.step += 1
            state.epoch, state.batch_index = (epoch, j + 1) if j + 1 < n_steps else (epoch + 1, 0)
            bar.update()
            if state.step % cfg["log_every"] == 0 or state.step == total_steps:
                elapsed = time.monotonic() - window_start
                row = {
                    "step": state.step,
                    "epoch": epoch,
                    "split": "train",
                    "lr": lr,
                    "grad_norm": float(grad_norm),
                    "tokens": window_tokens,
                    "tokens_per_s": window_tokens / elapsed,
                    **summarise(dict(zip(keys, window.tolist(), strict=True)), ttt),
                }
                state.rows.append(row)
                bar.set_postfix(
                    loss=f"{row['loss']:.3f}",
                    acc0=f"{row['full_acc_0']:.2f}",
                    tok_s=f"{row['tokens_per_s']:.0f}",
                    refresh=False,
                )
                window.zero_()
                window_tokens, window_start = 0, time.monotonic()
            end_of_epoch = j + 1 == n_steps
            if end_of_epoch or (cfg["eval_every"] and state.step % cfg["eval_every"] == 0):
                eval_start = time.monotonic()
                val = validate(epoch)
                if end_of_epoch and rt.is_main:
                    log.info(
                        "epoch %d: eval loss %.4f, estimated acceptance length %.3f",
                        epoch,
                        val["loss"],
                        val["estimated_acceptance_length"],
                    )
                window_start += time.monotonic() - eval_start  # tokens/s measures training, not validation
            if checkpoint_every and state.step % checkpoint_every == 0 and state.step < total_steps and rt.is_main:
                state.window = {**dict(zip(keys, window.tolist(), strict=True)), "tokens": window_tokens}
                path = save_checkpoint(ckpt_dir, fingerprint, model, optimizer, state, best, keep)
                log.info("checkpoint at step %d of %d: %s", state.step, total_steps, path)
            if hook and hook[0] == state.step:
                if rt.world_size > 1:
                    dist.barrier()  # rank 0's checkpoint is complete before anyone dies
                os.kill(os.getpid(), hook[1])
    bar.close()
    if rt.is_main:
        if best is None:
            raise RuntimeError("no validation ran, so there is no best draft to export")
        final = {k: v.detach() for k, v in model.state_dict().items()} | best
        with atomic_path(draft_out) as tmp_draft:
            export_draft(model, final, tmp_draft, serve_verifier_path)
        write_jsonl(metrics_out, state.rows)
        log.info("exported the best draft (step %d, eval loss %.4f) to %s", state.best_step, state.best_loss, draft_out)
        # Training is complete and its outputs are written: this run's checkpoints are spent.
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    if rt.world_size > 1:
        dist.barrier()


def run_from_json(spec: dict[str, Any]) -> None:
    """Entry for `python -m workflow_scripts.train SPEC.json` (and torchrun): the keyword
    arguments of run_train as JSON."""
    run_train(
        spec["shards"],
        spec["vocab_map"],
        spec["verifier_dir"],
        spec["draft_out"],
        spec["metrics_out"],
        index=spec["index"],
        checkpoint_dir=spec["checkpoint_dir"],
        serve_verifier_path=spec["serve_verifier_path"],
        cfg=spec["cfg"],
        threads=spec["threads"],
    )
