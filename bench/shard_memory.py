"""Host memory of offline training's data: every shard read into memory up front (what the
trainer did until 2026-12-04; `train.data.load_shards` still does it for tests and benches)
against refs and per-batch reads from the memory-mapped shards (`train.data.ShardSamples`,
what the trainer does now).

    .venv/bin/python bench/shard_memory.py [--gb 1.0] [--hidden 2048] [--batch-tokens 8192]

Writes synthetic bf16 shards (devkit's train inputs: 3 aux states and the final state per
token, the demo's layout) of about `--gb` gigabytes under a temporary folder, then in a fresh
process for each way: reads one epoch of packed batches as training does (the batch collated in float32) and
records the peak of its anonymous memory (RssAnon, sampled after setup and after every
batch: what the kernel cannot reclaim, what runs out) and of its resident set (VmHWM: with
the mapped shards' pages, which are page cache and reclaimable). Prints one Markdown row per
way and the per-batch read rate, which sets what reading costs a step at another model's
geometry (a Kimi-K2.5 batch of 8,192 tokens is 470 MB of bf16 states).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workflow"))  # the eagleflow package

from devkit.train_inputs import AUX_LAYERS, make_train_inputs
from eagleflow.train.data import ShardSamples, collate, load_shards, pack

AUX_STATES = AUX_LAYERS  # and the final state: the demo's layout
SAMPLE_TOKENS = (300, 900)  # sample lengths drawn uniformly from this range
SAMPLES_PER_SHARD = 64


def write_shards(out: Path, gb: float, hidden: int) -> list[str]:
    """Shards of random bf16 states (devkit's train inputs) for a verifier of `hidden`, about
    `gb` GB of states in all, 64 samples a shard, one of each 64 in the eval split."""
    from transformers import LlamaConfig

    verifier = out / "verifier"
    LlamaConfig(vocab_size=1024, hidden_size=hidden, num_hidden_layers=16, num_attention_heads=16).save_pretrained(
        verifier
    )
    g = torch.Generator().manual_seed(0)
    lengths, tokens = [], int(gb * 1e9 / ((AUX_STATES + 1) * hidden * 2))
    while sum(lengths) < tokens:
        lengths.append(int(torch.randint(*SAMPLE_TOKENS, (1,), generator=g)))
    evals = lengths[::SAMPLES_PER_SHARD]
    train = [n for i, n in enumerate(lengths) if i % SAMPLES_PER_SHARD]
    num_shards = -(-len(lengths) // SAMPLES_PER_SHARD)
    inputs = make_train_inputs(out / "in", verifier, train, evals, draft_vocab=512, num_shards=num_shards)
    return inputs["shards"]


def memory_kb() -> dict[str, int]:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("RssAnon", "VmHWM"):
            fields[name] = int(value.split()[0])
    return fields


def child(way: str, paths: list[str], batch_tokens: int) -> dict[str, float]:
    """One epoch of batches read as `way` reads them; peak memory and read time."""
    peak_anon = memory_kb()["RssAnon"]
    started = time.perf_counter()
    if way == "up front":
        train, _, _ = load_shards(paths)

        def read(items):
            return items

    else:
        source = ShardSamples(paths)
        train, _ = source.refs()
        read = source.samples
    setup_s = time.perf_counter() - started
    peak_anon = max(peak_anon, memory_kb()["RssAnon"])
    batches = pack(train, batch_tokens, shuffle_seed=0)
    tokens = 0
    started = time.perf_counter()
    for batch in batches:
        packed = collate(read([train[i] for i in batch]), batch_tokens)
        tokens += packed["input_ids"].shape[1]
        peak_anon = max(peak_anon, memory_kb()["RssAnon"])
    epoch_s = time.perf_counter() - started
    return {
        "setup_s": setup_s,
        "epoch_s": epoch_s,
        "batches": len(batches),
        "tokens": tokens,
        "peak_anon_mb": peak_anon / 1024,
        "peak_rss_mb": memory_kb()["VmHWM"] / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=1.0, help="GB of bf16 states to write")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--batch-tokens", type=int, default=8192)
    parser.add_argument("--child", nargs=2, metavar=("WAY", "SHARDS_JSON"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        way, shards = args.child
        print(json.dumps(child(way, json.loads(shards), args.batch_tokens)))
        return
    with tempfile.TemporaryDirectory(prefix="eagleflow-shard-memory-") as tmp:
        paths = write_shards(Path(tmp), args.gb, args.hidden)
        on_disk = sum(Path(p).stat().st_size for p in paths) / 1e6
        print(f"{len(paths)} shards, {on_disk:.0f} MB on disk, hidden {args.hidden}, {args.batch_tokens}-token batches")
        print("| way | setup s | one epoch s | batches | peak anonymous MB | peak RSS MB | MB of states read per s |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        rows = {}
        for way in ("up front", "per batch"):
            cmd = [sys.executable, __file__, "--batch-tokens", str(args.batch_tokens)]
            cmd += ["--child", way, json.dumps(paths)]
            r = rows[way] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
            state_mb = r["tokens"] * (AUX_STATES + 1) * args.hidden * 2 / 1e6
            rate = state_mb / (r["setup_s"] + r["epoch_s"])
            print(
                f"| {way} | {r['setup_s']:.2f} | {r['epoch_s']:.2f} | {r['batches']} | {r['peak_anon_mb']:.0f} "
                f"| {r['peak_rss_mb']:.0f} | {rate:.0f} |"
            )
        up, per = rows["up front"], rows["per batch"]
        print(
            f"\nper batch / up front: peak anonymous memory {per['peak_anon_mb'] / up['peak_anon_mb']:.3f}x, "
            f"setup + epoch time {(per['setup_s'] + per['epoch_s']) / (up['setup_s'] + up['epoch_s']):.2f}x"
        )


if __name__ == "__main__":
    main()
