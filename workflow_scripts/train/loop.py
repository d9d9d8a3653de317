"""The training loop, top to bottom: data, model, optimizer, step, eval, export.

Validation runs on the held-out split every `eval_every` steps and at the end of every
epoch; the draft exported is the one with the lowest validation loss. The estimated
acceptance length of a chain draft is 1 + sum_k full_acc_k, where full_acc_k is the
fraction of positions whose first k+1 draft tokens were all correct.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from tqdm import tqdm

from workflow_scripts.common.atomic import atomic_path
from workflow_scripts.train.data import collate, load_shards, pack
from workflow_scripts.train.draft import build_draft, export_draft

log = logging.getLogger(__name__)


def lr_at(step: int, total: int, base_lr: float, warmup: int, min_ratio: float = 0.1) -> float:
    """Linear warmup, then cosine decay to `min_ratio` * base_lr. Pure."""
    if step < warmup:
        return base_lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return base_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def summarise(metrics: list[dict[str, torch.Tensor]], ttt_steps: int) -> dict[str, float]:
    """Reduce speculators' per-batch {name_sum, name_total} metrics to means. Pure."""
    def ratio(name):
        s = sum(float(m[f"{name}_sum"]) for m in metrics)
        t = sum(float(m[f"{name}_total"]) for m in metrics)
        return s / t if t else 0.0

    out = {"loss": sum(float(m["loss_sum"]) for m in metrics) / max(1, len(metrics))}
    for k in range(ttt_steps):
        out[f"loss_{k}"] = ratio(f"loss_{k}")
        out[f"full_acc_{k}"] = ratio(f"full_acc_{k}")
        out[f"cond_acc_{k}"] = ratio(f"cond_acc_{k}")
    out["estimated_acceptance_length"] = 1.0 + sum(out[f"full_acc_{k}"] for k in range(ttt_steps))
    return out


@torch.no_grad()
def evaluate(model, samples, batch_tokens: int, fwd_kwargs: dict[str, Any]) -> dict[str, float]:
    model.eval()
    metrics = []
    for batch in pack(samples, batch_tokens, shuffle_seed=None):
        _, _, m = model(**collate([samples[i] for i in batch], batch_tokens), **fwd_kwargs)
        metrics.append(m)
    model.train()
    return summarise(metrics, fwd_kwargs["ttt_steps"])


def run_train(
    shards: list[str], vocab_map: str, verifier_dir: str, draft_out: str, metrics_out: str, *,
    serve_verifier_path: str, cfg: dict[str, Any], threads: int,
) -> None:  # fmt: skip
    torch.set_num_threads(threads)
    torch.manual_seed(cfg["seed"])
    train, evals, aux_layer_ids = load_shards(shards)
    if not train or not evals:
        raise ValueError(f"hidden-state shards hold {len(train)} train and {len(evals)} eval samples; both must be non-empty")
    vocab = load_file(vocab_map)
    model = build_draft(
        verifier_dir, vocab["d2t"], vocab["t2d"], num_layers=cfg["num_layers"], ttt_steps=cfg["ttt_steps"],
        aux_layer_ids=aux_layer_ids, attn_impl=cfg["attn_impl"],
    )  # fmt: skip
    from speculators.losses import resolve_loss_config

    fwd_kwargs = {
        "ttt_steps": cfg["ttt_steps"],
        "ttt_step_loss_decay": cfg["ttt_step_loss_decay"],
        "loss_config": resolve_loss_config(cfg["loss"], cfg["loss_implementation"]),
    }
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg["lr"], betas=(0.9, 0.95), weight_decay=cfg["weight_decay"])
    # The packing of every epoch is fixed up front (a pure function of the seed), so the
    # schedule knows the exact number of steps.
    epochs = [pack(train, cfg["batch_tokens"], shuffle_seed=cfg["seed"] * 1000 + e) for e in range(cfg["epochs"])]
    total_steps = sum(map(len, epochs))
    log.info(
        "draft: %.2fM trainable params; %d train / %d eval samples (%d / %d tokens); %d steps",
        sum(p.numel() for p in params) / 1e6, len(train), len(evals),
        sum(map(len, train)), sum(map(len, evals)), total_steps,
    )  # fmt: skip

    best_loss, best_state, step = math.inf, None, 0
    Path(metrics_out).parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(metrics_out) as tmp_metrics, open(tmp_metrics, "w") as mlog:

        def record(row):
            mlog.write(json.dumps(row) + "\n")
            mlog.flush()

        def validate(epoch):
            nonlocal best_loss, best_state
            val = evaluate(model, evals, cfg["batch_tokens"], fwd_kwargs)
            record({"step": step, "epoch": epoch, "split": "eval", **val})
            if val["loss"] < best_loss:
                best_loss = val["loss"]
                best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            return val

        model.train()
        bar = tqdm(total=total_steps, desc="train", unit="step", mininterval=2.0)
        window, window_tokens, window_start = [], 0, time.monotonic()
        for epoch, batches in enumerate(epochs):
            for batch_ids in batches:
                lr = lr_at(step, total_steps, cfg["lr"], cfg["warmup_steps"])
                for group in optimizer.param_groups:
                    group["lr"] = lr
                batch = collate([train[i] for i in batch_ids], cfg["batch_tokens"])
                _, loss, metrics = model(**batch, **fwd_kwargs)
                loss.backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg["grad_clip"])
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                window.append(metrics)
                window_tokens += batch["input_ids"].shape[1]
                bar.update()
                if step % cfg["log_every"] == 0 or step == total_steps:
                    elapsed = time.monotonic() - window_start
                    row = {"step": step, "epoch": epoch, "split": "train", "lr": lr, "grad_norm": float(grad_norm),
                           "tokens_per_s": window_tokens / elapsed, **summarise(window, cfg["ttt_steps"])}  # fmt: skip
                    record(row)
                    bar.set_postfix(loss=f"{row['loss']:.3f}", acc0=f"{row['full_acc_0']:.2f}", tok_s=f"{row['tokens_per_s']:.0f}", refresh=False)
                    window, window_tokens, window_start = [], 0, time.monotonic()
                if cfg["eval_every"] and step % cfg["eval_every"] == 0:
                    validate(epoch)
            val = validate(epoch)
            log.info("epoch %d: eval loss %.4f, estimated acceptance length %.3f", epoch, val["loss"], val["estimated_acceptance_length"])
        bar.close()
        with atomic_path(draft_out) as tmp_draft:
            export_draft(model, best_state, tmp_draft, serve_verifier_path)
    log.info("exported the best draft (eval loss %.4f) to %s", best_loss, draft_out)
