"""Online against offline training on a finished run's data: throughput and the estimate.

    .venv/bin/python bench/online_training.py [--workdir .] [--configfile my.yaml] [--epochs 1] [--rounds 2]

Reads a finished run of the config (its dataset, hidden-state index, vocab map and prepared
verifier) and trains the default draft with the config's train settings for `--epochs`,
alternating within each round:

- offline: from the stored states the index names, as the train rule runs it;
- online: from the dataset, computing every batch's states with the verifier
  (`hidden_states.mode: online`).

Same seed, same samples, same schedule. Throughput is the training tokens per second of the
metrics rows (validation excluded; online includes the verifier's forwards, which is what it
costs), also as process CPU time on this shared machine. Prints one Markdown row per mode
and round, and the median online/offline ratio; the last row's estimated acceptance length
comes from the final validation.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workflow"))  # the eagleflow package

from eagleflow.common.atomic import read_jsonl
from eagleflow.dag.plan.needs import load_merged_config
from eagleflow.train.loop import run_from_json


def spec(config: dict, workdir: Path, out: Path, mode: str, epochs: int) -> dict:
    run, hs = workdir / "results" / config["run"], config["hidden_states"]
    online = mode == "online"
    verifier = workdir / "resources/verifier" / config["verifier"]["name"]
    return {
        "shards": [],  # offline, training reads the states the index names
        "index": None if online else str(run / "hidden_states/index.json"),
        "dataset": [str(run / "dataset/train.parquet"), str(run / "dataset/eval.parquet")] if online else [],
        "online": {k: hs[k] for k in ("aux_layer_ids", "dtype", "compute_dtype", "batch_tokens")}
        | {"trust_remote_code": config["verifier"]["trust_remote_code"]}
        if online
        else None,
        "log_path": str(out / "logs/train.log"),
        "vocab_map": str(run / "vocab/default/vocab_map.safetensors"),
        "verifier_dir": str(verifier),
        "draft_out": str(out / "draft"),
        "metrics_out": str(out / "metrics.jsonl"),
        "checkpoint_dir": str(out / "checkpoints"),
        "serve_verifier_path": str(verifier),
        "cfg": {**config["train"], "epochs": epochs, "checkpoint_every": 0},
        "threads": len(os.sched_getaffinity(0)),
    }


def one(config: dict, workdir: Path, mode: str, epochs: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        s = spec(config, workdir, Path(tmp), mode, epochs)
        wall, cpu = time.monotonic(), time.process_time()
        run_from_json(s)
        wall, cpu = time.monotonic() - wall, time.process_time() - cpu
        rows = read_jsonl(s["metrics_out"])
    train = [r for r in rows if r["split"] == "train"]
    tokens = sum(r["tokens"] for r in train)
    train_s = sum(r["tokens"] / r["tokens_per_s"] for r in train)
    return {
        "mode": mode,
        "tokens": tokens,
        "tokens_per_s": tokens / train_s,
        "wall_s": wall,
        "cpu_s": cpu,
        "estimate": [r for r in rows if r["split"] == "eval"][-1]["estimated_acceptance_length"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, default=Path("."))
    ap.add_argument("--configfile", action="append", default=[])
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    config = load_merged_config(args.configfile, args.workdir)
    print("| round | mode | train tokens | tokens/s | wall s | CPU s | estimated acceptance |")
    print("|---|---|---|---|---|---|---|")
    ratios = []
    for r in range(args.rounds):
        got = {m: one(config, args.workdir, m, args.epochs) for m in ("offline", "online")}
        for m, g in got.items():
            print(
                f"| {r + 1} | {m} | {g['tokens']} | {g['tokens_per_s']:.0f} | {g['wall_s']:.0f} | {g['cpu_s']:.0f} "
                f"| {g['estimate']:.3f} |",
                flush=True,
            )
        ratios.append(got["online"]["tokens_per_s"] / got["offline"]["tokens_per_s"])
    print(f"\nonline/offline tokens per second, median of {args.rounds}: {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
