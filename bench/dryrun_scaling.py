"""How long `snakemake -n` takes on a production-size config, and how it grows with shards.

    .venv/bin/python bench/dryrun_scaling.py [--shards 16 64 256] [--samples 10000] [--repeats 3]
        [--generate-shards 1]

Builds, in a temporary directory, a copy of the workflow and the production example
(config/kimi-k2.5-8xgpu.yaml) pointed at a generated prompt file of `--samples` prompts,
then times `snakemake -n` (a fresh process each time, as a user runs it: interpreter start,
parsing, schema validation, code fingerprints, DAG) for each hidden-state shard count.
Prints a Markdown table with the median and the spread, and the growth relative to the
smallest shard count.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def prepare(workdir: Path, samples: int, shard_counts: list[int], generate_shards: int) -> dict[int, Path]:
    for name in ("workflow", "config"):
        src = REPO / name
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, workdir / name)
    prompts = workdir / "prompts.jsonl"
    with open(prompts, "w") as fh:
        for i in range(samples):
            fh.write(
                json.dumps({"id": f"p{i:06d}", "messages": [{"role": "user", "content": f"Question number {i}?"}]})
                + "\n"
            )
    verifier = workdir / "models/verifier"
    verifier.mkdir(parents=True)
    config = yaml.safe_load((REPO / "config/kimi-k2.5-8xgpu.yaml").read_text())
    config["prompts"]["source"] = str(prompts)
    config["verifier"]["path"] = config["verifier"]["serve_path"] = str(verifier)
    config["generate"]["shards"] = generate_shards
    paths = {}
    for shards in shard_counts:
        config["hidden_states"]["num_parts"] = shards
        paths[shards] = workdir / f"production-{shards}.yaml"
        paths[shards].write_text(yaml.safe_dump(config))
    return paths


def time_dry_run(workdir: Path, config: Path) -> tuple[float, float, int]:
    """(wall s, CPU s of the snakemake process, jobs planned)."""
    cmd = [sys.executable, "-m", "snakemake", "-n", "--configfile", str(config)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode != 0:
        sys.exit(f"snakemake -n failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    jobs = sum(1 for line in proc.stdout.splitlines() if line.startswith(("rule ", "localrule ")))
    return elapsed, cpu, jobs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--samples", type=int, default=10_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--generate-shards", type=int, default=1, help="generate.shards (verifier replicas)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="eagleflow-dryrun-") as tmp:
        workdir = Path(tmp)
        configs = prepare(workdir, args.samples, args.shards, args.generate_shards)
        time_dry_run(workdir, configs[args.shards[0]])  # warm the file cache and bytecode
        rows = []
        for shards in args.shards:
            runs = [time_dry_run(workdir, configs[shards]) for _ in range(args.repeats)]
            walls, cpus = [r[0] for r in runs], [r[1] for r in runs]
            rows.append((shards, runs[0][2], statistics.median(walls), min(walls), max(walls), statistics.median(cpus)))
    # CPU time is what the dry run costs; wall time on a shared machine adds whatever else runs.
    base = rows[0][5]
    print(
        f"`snakemake -n`, production example with {args.samples} prompts and {args.generate_shards} generate "
        f"shards, median of {args.repeats} fresh processes\n"
    )
    print(
        "| hidden-state shards | jobs | wall s (median) | wall "
        f"min–max | CPU s (median) | CPU vs. {rows[0][0]} shards |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for shards, jobs, median, lo, hi, cpu in rows:
        print(f"| {shards} | {jobs} | {median:.2f} | {lo:.2f}–{hi:.2f} | {cpu:.2f} | {cpu / base:.2f}x |")


if __name__ == "__main__":
    main()
