"""What the plan says when a Kimi-scale run grows: `--stored` samples extracted before, `--new`
added, at `--tokens` tokens a sample (the Kimi example's mean).

    .venv/bin/python bench/grown_states_plan.py [--stored 30000] [--new 1000] [--tokens 2500]

Builds, in a temporary directory, the state a finished run of config/kimi-k2.5-8xgpu.yaml
leaves: a dataset of stored + new samples, the part manifest of the extraction that stored
the first `--stored` of them, and their files in the sample store (empty: the plan looks
only at which keys are there). Then makes the plan as `python -m eagleflow.plan` does
(the verifier's config from config/verifiers/kimi-k2.5.json) and prints what it counts:
samples and tokens to extract, bytes written, the hidden-state hours, and the seconds the
plan took to key every sample.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))

from eagleflow.dag.plan.hours import measured_rates, planned_work, stage_hours  # noqa: E402
from eagleflow.dag.plan.needs import load_merged_config, make_plan  # noqa: E402
from eagleflow.hidden_states.sample_keys import sample_key  # noqa: E402
from eagleflow.runtime.state_store import SampleStore  # noqa: E402

SETTINGS_KEY = "kimi-example-extraction"  # any fixed key: the plan reads it from the manifest


def build(root: Path, config: dict, stored: int, new: int, tokens: int) -> None:
    run = root / f"results/{config['run']}"
    rows = [
        {"id": f"p{i:06d}#t0", "input_ids": [(i * 7919 + t) % 160000 for t in range(tokens)], "length": tokens}
        for i in range(stored + new)
    ]
    for r in rows:
        r["loss_mask"] = [0] * 64 + [1] * (tokens - 64)
    (run / "dataset").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows[:-50]), run / "dataset/train.parquet")
    pq.write_table(pa.Table.from_pylist(rows[-50:]), run / "dataset/eval.parquet")
    states = run / "hidden_states"
    store = SampleStore(states / "samples")
    for r in rows[:stored]:
        path = store.path(sample_key(SETTINGS_KEY, r["input_ids"], r["loss_mask"]))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    (states / "part-00000.json").write_text(json.dumps({"settings_key": SETTINGS_KEY, "samples": []}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stored", type=int, default=30000)
    ap.add_argument("--new", type=int, default=1000)
    ap.add_argument("--tokens", type=int, default=2500)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        config = load_merged_config([str(REPO / "config/kimi-k2.5-8xgpu.yaml")], REPO)
        build(root, config, args.stored, args.new, args.tokens)
        verifier = json.loads((REPO / "config/verifiers/kimi-k2.5.json").read_text())
        started = time.monotonic()
        plan = make_plan(config, root, verifier_config=verifier, gpu_memory=80 * 2**30)
        took = time.monotonic() - started
        t, disk = plan.tokens, plan.disk[0]
        from eagleflow.common.config import typed
        from eagleflow.dag.plan.hours import Rates

        rates, _ = measured_rates(root, config["run"], typed(Rates, config["throughput"], "throughput"))
        hours = {}
        for label, stored_tokens in (("grown (the store holds the rest)", t.stored_tokens), ("every sample again", 0)):
            work = planned_work(t.samples, t.tokens, True, config, rates, stored_tokens)
            hours[label] = stage_hours(work, rates, 1, config)["hidden_states"]
    print(f"samples {t.samples:,} ({t.stored_samples:,} stored, {t.new_samples:,} new)")
    print(f"tokens to extract {t.new_tokens:,} of {t.tokens:,}")
    print(f"bytes written {disk['bytes'] / 1e9:.1f} GB ({disk['what']})")
    for label, h in hours.items():
        print(f"hidden-state hours, {label}: {h:.2f} (verifier load included)")
    print(f"plan: {took:.1f} s to key {t.samples:,} samples")


if __name__ == "__main__":
    main()
