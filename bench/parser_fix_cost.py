"""What a parser fix costs on a finished run: the rules rerun, their wall time, and the
requests sent to the verifier, until the training data (`dataset/`) is rebuilt.

    python bench/parser_fix_cost.py --run demo [--configfile CONFIG] [--cores 2]

Run it in a workflow directory whose run is finished. It appends a behaviour change to
`workflow/eagleflow/synth/assemble.py` (a new module-level constant: the code fingerprint of
every rule that runs the module changes), lists what `snakemake -n` plans and why, rebuilds
`dataset/` and restores the file. Everything downstream of `dataset/` (hidden states,
training, benchmark) is rebuilt by any data fix and is not counted.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workflow"))  # the eagleflow package

from devkit.runs import planned_jobs

EDIT = "\n_PARSER_FIX_BENCHMARK = 1\n"


def plan(cmd: list[str]) -> dict[str, str]:
    return planned_jobs(subprocess.run([*cmd, "-n"], capture_output=True, text=True, check=True).stdout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", default="demo")
    p.add_argument("--configfile", default=None)
    p.add_argument("--cores", default="2")
    a = p.parse_args()
    results = Path("results") / a.run
    targets = [str(results / "dataset/train.parquet"), str(results / "dataset/eval.parquet")]
    # Targets first: --configfile takes every word after it.
    cmd = [
        sys.executable,
        "-m",
        "snakemake",
        *targets,
        "--cores",
        a.cores,
        *(["--configfile", a.configfile] if a.configfile else []),
    ]
    if plan(cmd):
        sys.exit(f"{results}: the run is not finished up to dataset/ ({', '.join(plan(cmd))} planned); finish it first")
    stats_path = results / "generate/stats.json"
    stats_before = stats_path.stat().st_mtime if stats_path.exists() else None
    module = Path("workflow/eagleflow/synth/assemble.py")
    original = module.read_text()
    try:
        module.write_text(original + EDIT)
        planned = plan(cmd)
        started = time.monotonic()
        subprocess.run(cmd, capture_output=True, text=True, check=True)
        wall = time.monotonic() - started
    finally:
        module.write_text(original)
    generated = stats_path.exists() and stats_path.stat().st_mtime != stats_before
    sent = json.loads(stats_path.read_text())["sent"] if generated else 0
    samples = json.loads((results / "synth/quality.json").read_text())["num_samples"]
    print(
        json.dumps({"planned": planned, "wall_s": round(wall, 1), "requests_sent": sent, "samples": samples}, indent=2)
    )
    print("note: the edit is reverted; the next run rebuilds from synth again (nothing is sent)", file=sys.stderr)


if __name__ == "__main__":
    main()
