"""Training loop overhead: eagleflow's run_train against a bare speculators step, same batches.

    .venv/bin/python bench/train_overhead.py [--rounds 2] [--epochs 1] [--checkpoint-every 10]

Builds a verifier with SmolLM2-135M's geometry (hidden 576, 9 heads of 64, vocab 49152; 4
layers, since only embeddings and lm_head reach the draft) from a config, and synthetic
hidden-state shards (nothing downloaded). Then, alternating within each round:

- loop: `run_train` as the rule runs it (packing, collate, lr schedule, grad clipping,
  AdamW, metrics reduction and logging, checkpoints at the given cadence).
- bare: the same draft (same seed) and AdamW, `Eagle3DraftModel` forward, backward,
  optimizer step and zero_grad over the same batches in the same order, collated up front.

Both are timed the same way: AdamW is replaced by a subclass that stamps the clocks after
every `step()`, and throughput is the tokens of steps 2..N over the time from the end of
step 1 to the end of step N (model build, the first step's warm-up, the final validation
and export are outside; everything the loop does between steps is inside). On a shared
machine wall time swings with other jobs' load, so process CPU time is reported too.
Prints one Markdown row per round and the medians of loop/bare (1.0 = no overhead).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workflow"))  # the eagleflow package

from devkit.configs import build_draft
from devkit.train_inputs import make_train_inputs
from eagleflow.common.atomic import read_jsonl
from eagleflow.common.config import typed
from eagleflow.train.config import TrainConfig, TrainJob
from eagleflow.train.data import collate, load_shards, pack
from eagleflow.train.loop import run_train


def smollm2_geometry_verifier(out: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=4,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(out)
    return out


STAMPS: list[tuple[float, float]] = []


class StampedAdamW(torch.optim.AdamW):
    def step(self, closure=None):
        loss = super().step(closure)
        STAMPS.append((time.perf_counter(), time.process_time()))
        return loss


def rates(token_counts: list[int]) -> tuple[float, float]:
    """(wall tok/s, CPU tok/s) over steps 2..N from the optimizer stamps."""
    assert len(STAMPS) == len(token_counts), f"{len(STAMPS)} optimizer steps for {len(token_counts)} batches"
    tokens = sum(token_counts[1:])
    (w0, c0), (w1, c1) = STAMPS[0], STAMPS[-1]
    return tokens / (w1 - w0), tokens / (c1 - c0)


def run_loop(inputs, verifier: Path, cfg: dict, threads: int, out: Path) -> int:
    STAMPS.clear()
    job = TrainJob(
        shards=inputs["shards"],
        vocab_map=inputs["vocab_map"],
        index=inputs["index"],
        verifier_dir=str(verifier),
        draft_out=str(out / "draft"),
        metrics_out=str(out / "metrics.jsonl"),
        checkpoint_dir=str(out / "checkpoints"),
        serve_verifier_path=str(verifier),
        threads=threads,
    )
    run_train(job, typed(TrainConfig, cfg, "train"))
    return max(r["step"] for r in read_jsonl(out / "metrics.jsonl"))


def bare_draft(inputs, verifier: Path, cfg: dict):
    """(draft, training samples, the forward's loss arguments) as run_train builds them from the
    `train` section `cfg`, with SDPA attention."""
    from speculators.losses import resolve_loss_config

    train, _, aux = load_shards(inputs["shards"])
    vocab = load_file(inputs["vocab_map"])
    model = build_draft(
        str(verifier),
        vocab["d2t"],
        vocab["t2d"],
        num_layers=cfg["num_layers"],
        ttt_steps=cfg["ttt_steps"],
        aux_layer_ids=aux,
        attn_impl="sdpa",
    )
    kwargs = {
        "ttt_steps": cfg["ttt_steps"],
        "ttt_step_loss_decay": cfg["ttt_step_loss_decay"],
        "loss_config": resolve_loss_config(cfg["loss"], "eager"),
    }
    return model, train, kwargs


def run_bare(inputs, verifier: Path, cfg: dict, threads: int) -> list[int]:
    """Tokens per step, in order."""
    torch.set_num_threads(threads)
    torch.manual_seed(cfg["seed"])
    model, train, kwargs = bare_draft(inputs, verifier, cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = StampedAdamW(params, lr=cfg["lr"], betas=(0.9, 0.95), weight_decay=cfg["weight_decay"])
    batches = [
        collate([train[i] for i in b], cfg["batch_tokens"])
        for e in range(cfg["epochs"])
        for b in pack(train, cfg["batch_tokens"], shuffle_seed=cfg["seed"] * 1000 + e)
    ]
    model.train()
    STAMPS.clear()
    for batch in batches:
        _, loss, _ = model(**batch, **kwargs)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [b["input_ids"].shape[1] for b in batches]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--samples", type=int, default=48, help="train samples (lengths 128-512 tokens)")
    ap.add_argument(
        "--checkpoint-every", type=int, default=None, help="default: config/config.yaml's train.checkpoint_every"
    )
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.optim.AdamW = StampedAdamW  # run_train builds its optimizer as torch.optim.AdamW

    cfg = yaml.safe_load((Path(__file__).resolve().parents[1] / "config" / "config.yaml").read_text())["train"]
    # AdamW on both sides: the bare step is an AdamW step, and the stamps are AdamW's.
    cfg = {**cfg, "epochs": args.epochs, "eval_every": 0, "optimizer": "adamw"}
    if args.checkpoint_every is not None:
        cfg["checkpoint_every"] = args.checkpoint_every
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(128, 513, (args.samples,), generator=g).tolist()
    with tempfile.TemporaryDirectory(prefix="eagleflow-train-overhead-") as tmp:
        tmp = Path(tmp)
        verifier = smollm2_geometry_verifier(tmp / "verifier")
        inputs = make_train_inputs(tmp / "in", verifier, lengths, [256, 256], draft_vocab=8192)
        print(
            f"train config: batch_tokens {cfg['batch_tokens']}, log_every {cfg['log_every']}, checkpoint_every "
            f"{cfg['checkpoint_every']}, attn {cfg['attn_impl']}, loss {cfg['loss_implementation']}; "
            f"{args.samples} samples, {args.epochs} epoch(s), {args.threads} threads\n"
        )
        print(
            "| round | steps | timed tokens | loop wall tok/s | bare wall tok/s "
            "| wall loop/bare | loop CPU tok/s | bare CPU tok/s | CPU loop/bare |"
        )
        print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        wall, cpu = [], []
        for r in range(args.rounds):
            # Alternate the order so that a load change on the machine does not favour one side.
            order = ("loop", "bare") if r % 2 == 0 else ("bare", "loop")
            got = {}
            for which in order:
                if which == "loop":
                    steps = run_loop(inputs, verifier, cfg, args.threads, tmp / f"run-{r}")
                    loop_stamps = list(STAMPS)
                else:
                    counts = run_bare(inputs, verifier, cfg, args.threads)
                    got["bare"] = rates(counts)
            STAMPS[:] = loop_stamps
            got["loop"] = rates(counts)
            assert steps == len(counts), f"loop took {steps} steps, bare {len(counts)}"
            wall.append(got["loop"][0] / got["bare"][0])
            cpu.append(got["loop"][1] / got["bare"][1])
            print(
                f"| {r} | {steps} | {sum(counts[1:])} | {got['loop'][0]:.0f} | {got['bare'][0]:.0f} | {wall[-1]:.3f} "
                f"| {got['loop'][1]:.0f} | {got['bare'][1]:.0f} | {cpu[-1]:.3f} |",
                flush=True,
            )
        mw, mc = statistics.median(wall), statistics.median(cpu)
        print(
            f"\nmedian loop/bare: wall {mw:.3f} (overhead {100 * (1 / mw - 1):.1f}%), "
            f"CPU {mc:.3f} (overhead {100 * (1 / mc - 1):.1f}%)"
        )
        checkpoint_cost(inputs, verifier, cfg, args.threads, tmp / "ckpt-cost", sum(counts) / len(counts))


def checkpoint_cost(inputs, verifier: Path, cfg: dict, threads: int, out: Path, tokens_per_step: float) -> None:
    """One checkpoint's write time, alone (median of 3), and what it costs per step at the cadence."""
    from eagleflow.train.checkpoint import TrainState, save_checkpoint

    run_bare(inputs, verifier, cfg, threads)  # a trained draft and a filled optimizer state
    (w0, _), (w1, _) = STAMPS[0], STAMPS[-1]
    step_s = (w1 - w0) / (len(STAMPS) - 1)
    vocab = load_file(inputs["vocab_map"])
    model = build_draft(
        str(verifier),
        vocab["d2t"],
        vocab["t2d"],
        num_layers=cfg["num_layers"],
        ttt_steps=cfg["ttt_steps"],
        aux_layer_ids=load_shards(inputs["shards"])[2],
        attn_impl="sdpa",
    )
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    best = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    times = []
    for i in range(3):
        start = time.perf_counter()
        save_checkpoint(out, "bench", model, opt, TrainState(step=i + 1), best, keep=2)
        times.append(time.perf_counter() - start)
    size = sum(f.stat().st_size for f in (out / f"step-{3:08d}").iterdir()) / 2**20
    every = cfg["checkpoint_every"]
    cost = statistics.median(times)
    print(
        f"one checkpoint: {size:.0f} MiB in {cost:.2f} s; a step ({tokens_per_step:.0f} tokens) {step_s:.2f} s; "
        f"at checkpoint_every {every}: {100 * cost / (every * step_s) if every else 0:.1f}% of training time"
    )


if __name__ == "__main__":
    main()
