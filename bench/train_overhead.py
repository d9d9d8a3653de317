"""Training loop overhead: eagleflow's run_train against a bare speculators step, same batches.

    .venv/bin/python bench/train_overhead.py [--rounds 2] [--epochs 1] [--checkpoint-every 10]

Builds a verifier with SmolLM2-135M's geometry (hidden 576, 9 heads of 64, vocab 49152; 4
layers, since only embeddings and lm_head reach the draft) from a config, and synthetic
hidden-state shards (nothing downloaded). Then, alternating within each round:

- loop: `run_train` as the rule runs it (packing, collate, lr schedule, grad clipping,
  AdamW, metrics reduction and logging, checkpoints at the given cadence). Its tokens/s is
  read back from metrics.jsonl (train tokens over train wall time; validation excluded).
- bare: the same draft (same seed) and AdamW, `Eagle3DraftModel` forward, backward,
  optimizer step and zero_grad over the same batches in the same order, collated up front.

Prints one Markdown row per round and the median ratio loop/bare (1.0 = no overhead).
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

from tests.train_inputs import make_train_inputs  # noqa: E402
from workflow_scripts.common.atomic import read_jsonl  # noqa: E402
from workflow_scripts.train.data import collate, load_shards, pack  # noqa: E402
from workflow_scripts.train.draft import build_draft  # noqa: E402
from workflow_scripts.train.loop import run_train  # noqa: E402


def smollm2_geometry_verifier(out: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5,
                         tie_word_embeddings=False)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(out)
    return out


def loop_tokens_per_s(inputs, verifier: Path, cfg: dict, threads: int, out: Path) -> tuple[float, int, int]:
    run_train(inputs["shards"], inputs["vocab_map"], str(verifier), str(out / "draft"), str(out / "metrics.jsonl"),
              index=inputs["index"], checkpoint_dir=str(out / "checkpoints"), serve_verifier_path=str(verifier),
              cfg=cfg, threads=threads)  # fmt: skip
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if r["split"] == "train"]
    tokens = sum(r["tokens"] for r in rows)
    return tokens / sum(r["tokens"] / r["tokens_per_s"] for r in rows), tokens, rows[-1]["step"]


def bare_tokens_per_s(inputs, verifier: Path, cfg: dict, threads: int) -> tuple[float, int, int]:
    from speculators.losses import resolve_loss_config

    torch.set_num_threads(threads)
    torch.manual_seed(cfg["seed"])
    train, _, aux = load_shards(inputs["shards"])
    vocab = load_file(inputs["vocab_map"])
    model = build_draft(str(verifier), vocab["d2t"], vocab["t2d"], num_layers=cfg["num_layers"], ttt_steps=cfg["ttt_steps"],
                        aux_layer_ids=aux, attn_impl="sdpa")  # fmt: skip
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg["lr"], betas=(0.9, 0.95), weight_decay=cfg["weight_decay"])
    kwargs = {"ttt_steps": cfg["ttt_steps"], "ttt_step_loss_decay": cfg["ttt_step_loss_decay"],
              "loss_config": resolve_loss_config(cfg["loss"], "eager")}  # fmt: skip
    batches = [collate([train[i] for i in b], cfg["batch_tokens"])
               for e in range(cfg["epochs"]) for b in pack(train, cfg["batch_tokens"], shuffle_seed=cfg["seed"] * 1000 + e)]  # fmt: skip
    model.train()
    start = time.perf_counter()
    for batch in batches:
        _, loss, _ = model(**batch, **kwargs)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    elapsed = time.perf_counter() - start
    tokens = sum(b["input_ids"].shape[1] for b in batches)
    return tokens / elapsed, tokens, len(batches)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--samples", type=int, default=48, help="train samples (lengths 128-512 tokens)")
    ap.add_argument("--checkpoint-every", type=int, default=None, help="default: config/config.yaml's train.checkpoint_every")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)

    cfg = yaml.safe_load((Path(__file__).resolve().parents[1] / "config" / "config.yaml").read_text())["train"]
    cfg = {**cfg, "epochs": args.epochs, "eval_every": 0}
    if args.checkpoint_every is not None:
        cfg["checkpoint_every"] = args.checkpoint_every
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(128, 513, (args.samples,), generator=g).tolist()
    with tempfile.TemporaryDirectory(prefix="eagleflow-train-overhead-") as tmp:
        tmp = Path(tmp)
        verifier = smollm2_geometry_verifier(tmp / "verifier")
        inputs = make_train_inputs(tmp / "in", verifier, lengths, [256, 256], draft_vocab=8192)
        print(f"train config: batch_tokens {cfg['batch_tokens']}, log_every {cfg['log_every']}, checkpoint_every "
              f"{cfg['checkpoint_every']}, attn {cfg['attn_impl']}, loss {cfg['loss_implementation']}; "
              f"{args.samples} samples, {args.epochs} epoch(s), {args.threads} threads\n")  # fmt: skip
        print("| round | steps | tokens | loop tok/s | bare tok/s | loop / bare |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: |")
        ratios = []
        for r in range(args.rounds):
            out = tmp / f"run-{r}"
            loop, tokens, steps = loop_tokens_per_s(inputs, verifier, cfg, args.threads, out)
            bare, bare_tokens, bare_steps = bare_tokens_per_s(inputs, verifier, cfg, args.threads)
            assert (bare_tokens, bare_steps) == (tokens, steps), f"batches differ: loop {tokens}/{steps}, bare {bare_tokens}/{bare_steps}"
            ratios.append(loop / bare)
            print(f"| {r} | {steps} | {tokens} | {loop:.0f} | {bare:.0f} | {loop / bare:.3f} |", flush=True)
        print(f"\nmedian loop/bare throughput: {statistics.median(ratios):.3f} (overhead {100 * (1 - statistics.median(ratios)):.1f}%)")


if __name__ == "__main__":
    main()
