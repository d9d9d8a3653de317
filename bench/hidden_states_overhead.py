"""Capture overhead of the hf hidden-state backend: tokens/s of the real capture path
(`hidden_states.extract`: hooks, gather, bf16 copy to host, unpadding) against a plain
forward of the same base model over the same padded batches, side by side in one run.

    .venv/bin/python bench/hidden_states_overhead.py [VERIFIER_DIR] \
        [--samples 24] [--max-len 512] [--rounds 2] [--threads 2]

VERIFIER_DIR defaults to the embedded SmolLM2 in resources/verifier (prepared by `make
demo`; read only), else a 12-layer Llama (hidden 576) built from a config. Compute dtype float32 on
CPU (docs/facts.md: bf16 matmuls take slow paths here), storage bf16. Passes alternate
A B B A per round so drift hits both. Target: capture/plain time ratio <= 1.10.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from eagleflow.hidden_states.forward import decoder_parts, extract, load_verifier, token_budget_batches
from eagleflow.hidden_states.layers import default_aux_layer_ids

EMBEDDED = Path(__file__).resolve().parents[1] / "resources/verifier/smollm2-135m-instruct"


def fallback_verifier(out: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=12,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(out)
    return out


@torch.inference_mode()
def plain(model, samples, batch_tokens):
    base, _, _ = decoder_parts(model, model.config.num_hidden_layers)
    lengths = [len(s["input_ids"]) for s in samples]
    for batch in token_budget_batches(lengths, batch_tokens):
        width = max(lengths[i] for i in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, i in enumerate(batch):
            ids[row, : lengths[i]] = torch.tensor(samples[i]["input_ids"])
            mask[row, : lengths[i]] = 1
        base(input_ids=ids.to(model.device), attention_mask=mask.to(model.device), use_cache=False)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("verifier", nargs="?")
    ap.add_argument("--samples", type=int, default=24)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    verifier = (
        Path(args.verifier)
        if args.verifier
        else EMBEDDED
        if EMBEDDED.exists()
        else fallback_verifier(Path(tempfile.mkdtemp()) / "llama")
    )
    model = load_verifier(str(verifier), "cpu", torch.float32)
    vocab = json.loads((verifier / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    samples = [
        {"input_ids": [rng.randrange(vocab) for _ in range(rng.randint(64, args.max_len))]} for _ in range(args.samples)
    ]
    tokens = sum(len(s["input_ids"]) for s in samples)
    aux = default_aux_layer_ids(model.config.num_hidden_layers)

    def capture():
        extract(model, samples, aux, args.batch_tokens, torch.bfloat16)

    def forward():
        plain(model, samples, args.batch_tokens)

    forward()  # warm-up (allocator, oneDNN kernels)
    capture()  # warm-up of the capture path's own kernels (bf16 conversion)
    times = {"plain": [], "capture": []}
    round_ratios = []
    for _ in range(args.rounds):
        for name, fn in (("plain", forward), ("capture", capture), ("capture", capture), ("plain", forward)):
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
            print(f"  {name}: {times[name][-1]:.2f} s", flush=True)
        round_ratios.append(sum(times["capture"][-2:]) / sum(times["plain"][-2:]))
    p, c = sum(times["plain"]), sum(times["capture"])
    n = len(times["plain"])
    print(
        f"verifier {verifier} ({model.config.num_hidden_layers} layers, hidden {model.config.hidden_size}); "
        f"{args.samples} samples, {tokens} tokens; batch_tokens {args.batch_tokens}; {args.threads} threads; aux {aux}"
    )
    print("| path | passes | tokens/s | s/pass (min-max) |")
    print("| --- | ---: | ---: | --- |")
    for name in ("plain", "capture"):
        ts = times[name]
        print(
            f"| {name} | {len(ts)} | {tokens * len(ts) / sum(ts):.0f} "
            f"| {sum(ts) / len(ts):.2f} ({min(ts):.2f}-{max(ts):.2f}) |"
        )
    print(
        f"capture / plain time ratio: {c / p:.3f} (overhead {100 * (c / p - 1):+.1f}%, {n} passes each); "
        f"per round (A B B A): median {statistics.median(round_ratios):.3f}, "
        f"range {min(round_ratios):.3f}-{max(round_ratios):.3f}"
    )


if __name__ == "__main__":
    main()
