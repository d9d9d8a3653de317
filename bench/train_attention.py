"""Training step time of the draft with sdpa against doc_sdpa (SDPA per packed sample), side by side.

    python bench/train_attention.py results/demo --steps 20

On one finished run's hidden states: two drafts built from the same seed, one per attention
implementation, each takes the same packed batches (the demo's train settings) in turns, a
forward, backward and AdamW step each; after two warm-up steps each the steps are timed. Prints
seconds per step of each, the ratio, and the largest difference of their losses (they compute
the same function). Alternating the steps spreads the machine's noise over both.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file
from speculators.losses import resolve_loss_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # devkit

from devkit.configs import build_draft
from eagleflow.train.data import ShardSamples, collate, pack


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    run = Path(args.run_dir)
    config = yaml.safe_load(Path("config/config.yaml").read_text())
    cfg = config["train"]
    verifier = f"resources/verifier/{config['verifier']['name']}"
    vocab = load_file(str(run / "vocab/default/vocab_map.safetensors"))
    source = ShardSamples.from_index(run / "hidden_states/index.json", t2d=vocab["t2d"])
    train, aux = source.samples(source.refs()[0]), source.aux_layer_ids
    batches = [collate([train[i] for i in b], cfg["batch_tokens"]) for b in pack(train, cfg["batch_tokens"], 0)]
    batches = batches[: args.steps + 2]
    kwargs = {
        "ttt_steps": cfg["ttt_steps"],
        "ttt_step_loss_decay": cfg["ttt_step_loss_decay"],
        "loss_config": resolve_loss_config(cfg["loss"], "eager"),
    }
    impls = ("sdpa", "doc_sdpa")
    runs = {}
    for impl in impls:
        torch.manual_seed(0)
        model = build_draft(
            verifier,
            vocab["d2t"],
            vocab["t2d"],
            num_layers=cfg["num_layers"],
            ttt_steps=cfg["ttt_steps"],
            aux_layer_ids=aux,
            attn_impl=impl,
        )
        params = [p for p in model.parameters() if p.requires_grad]
        runs[impl] = (model, torch.optim.AdamW(params, lr=cfg["lr"]), [], [])
    for i, batch in enumerate(batches):
        for impl in impls if i % 2 == 0 else impls[::-1]:
            model, optimizer, times, losses = runs[impl]
            started = time.perf_counter()
            _, loss, _ = model(**batch, **kwargs)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if i >= 2:
                times.append(time.perf_counter() - started)
            losses.append(float(loss))
    tokens = sum(int(b["input_ids"].shape[1]) for b in batches[2:])
    samples = sum(int(b["document_ids"].max()) + 1 for b in batches[2:])
    print(f"{len(batches) - 2} timed steps, {tokens} tokens, {samples} packed samples ({tokens / samples:.0f} each)")
    print("| attention | s/step | tokens/s |")
    print("| --- | ---: | ---: |")
    for impl in impls:
        times = runs[impl][2]
        print(f"| {impl} | {sum(times) / len(times):.3f} | {tokens / sum(times):.0f} |")
    ratio = sum(runs["sdpa"][2]) / sum(runs["doc_sdpa"][2])
    diff = max(abs(a - b) for a, b in zip(runs["sdpa"][3], runs["doc_sdpa"][3], strict=True))
    print(f"\nsdpa / doc_sdpa time: {ratio:.2f}x; largest loss difference over the steps: {diff:.2e}")


if __name__ == "__main__":
    main()
