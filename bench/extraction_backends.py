"""The hidden-state phase of a run through each backend, one after the other on one machine.

    python bench/extraction_backends.py --workdir DIR [--configfile FILE ...] [--out FILE]

DIR is a workflow copy whose run has its dataset (e.g. `snakemake results/demo/dataset/
train.parquet results/demo/dataset/eval.parquet` in a copy of this repository). For each
backend (`hf`, then `vllm`) the phase's shard jobs and index run through Snakemake as a user
runs them (`--forcerun hidden_states`, `hidden_states.backend` set on the command line); a
backend's shards are kept aside between runs, so that each run extracts (the shard cache
would otherwise link the first run's shards back). Reported per backend: the phase's wall
time, the server's start-up (from the shard logs), tokens/s after start-up, and the states'
relative L2 distance between the backends' shards.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from workflow_scripts.hidden_states.shard_file import read_shard  # noqa: E402


def run_name(workdir: Path, configfiles: list[str]) -> str:
    name = yaml.safe_load((workdir / "config/config.yaml").read_text())["run"]
    for f in configfiles:
        name = (yaml.safe_load(Path(f).read_text()) or {}).get("run", name)
    return name


def phase(workdir: Path, run: str, backend: str, configfiles: list[str]) -> dict:
    results = workdir / "results" / run
    shutil.rmtree(results / "hidden_states", ignore_errors=True)  # the shards and their cache
    cmd = [sys.executable, "-m", "snakemake", f"results/{run}/hidden_states/index.json", "--cores", "all"]
    cmd += ["--forcerun", "hidden_states", "--config", f"hidden_states.backend={backend}"]
    if configfiles:
        cmd += ["--configfile", *configfiles]
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{backend}: snakemake failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    logs = sorted((results / "logs").glob("hidden_states.shard-*.log"))
    waited = [int(m) for p in logs for m in re.findall(r"healthy \(waited (\d+) s\)", p.read_text())]
    jobs = [float(m) for p in logs for m in re.findall(r"tokens in ([\d.]+) s", p.read_text())]
    kept = workdir / f"bench-shards-{backend}"
    shutil.rmtree(kept, ignore_errors=True)
    shutil.copytree(results / "hidden_states", kept, ignore=shutil.ignore_patterns(".done"))
    index = json.loads((kept / "index.json").read_text())
    tokens = index["num_tokens"]
    startup = max(waited, default=0)
    return {
        "phase_wall_s": round(wall, 1),
        "shard_jobs_s": [round(j, 1) for j in jobs],
        "startup_s": startup,
        "tokens": tokens,
        "tokens_per_s_after_startup": round(tokens / max(wall - startup, 1e-9), 1),
        "shards": str(kept),
    }


def distance(a: Path, b: Path) -> dict:
    out = {"aux": [0.0, 0.0], "final": [0.0, 0.0]}
    for shard in sorted(a.glob("shard-*.safetensors")):
        _, xs = read_shard(shard)
        _, ys = read_shard(b / shard.name)
        for x, y in zip(xs, ys, strict=True):
            assert x.id == y.id and torch.equal(x.input_ids, y.input_ids)
            for name in out:
                want, got = getattr(x, name), getattr(y, name)
                out[name][0] += (got - want).pow(2).sum().item()
                out[name][1] += want.pow(2).sum().item()
    return {f"{name}_rel_l2": (num / den) ** 0.5 for name, (num, den) in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", required=True, type=Path)
    ap.add_argument("--configfile", action="append", default=[])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    run = run_name(args.workdir, args.configfile)
    report = {}
    for backend in ("hf", "vllm"):
        report[backend] = phase(args.workdir, run, backend, args.configfile)
        print(backend, report[backend], flush=True)
    report["vllm_over_hf_wall"] = round(report["vllm"]["phase_wall_s"] / report["hf"]["phase_wall_s"], 3)
    report |= distance(Path(report["hf"]["shards"]), Path(report["vllm"]["shards"]))
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
