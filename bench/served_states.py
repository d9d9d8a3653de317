"""Served against offline hidden states on a finished run's data: the extraction and the
training of the same draft, each in a fresh copy of the run with no stored state and no draft,
one after the other (`--order` alternates them), through the same Snakemake command to `train`.

    .venv/bin/python bench/served_states.py --workdir DEMO [--configfile ...] [--transfer mooncake]

Per mode: wall time (the rules `hidden_states`, `hidden_states_index` and `train`), the peak
disk the run's results and the transfer's directory hold beyond the copy's start, the peak
resident memory of the Snakemake process tree (sampled every 0.5 s: the job, the trainer, vLLM
and, served, the Mooncake master), and from the served run's stats row the samples/s one server
fed against the trainer's step rate, the seconds the trainer waited on states and those the
feed held requests back (where the bottleneck is). The drafts of both runs are kept under
`--out` for vLLM to measure (bench/standard_sets.py --draft served=... offline=...).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from devkit.runs import copy_workflow  # noqa: E402


def tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo.extend(children.get(p, []))
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


def du(paths: list[Path]) -> int:
    total = 0
    for root in paths:
        for dirpath, _, files in os.walk(root):
            for name in files:
                try:
                    total += os.lstat(os.path.join(dirpath, name)).st_size
                except OSError:
                    continue
    return total


class Peaks(threading.Thread):
    """The most resident memory of a process tree and the most bytes under `paths` above their start."""

    def __init__(self, pid: int, paths: list[Path]):
        super().__init__(daemon=True)
        self.pid, self.paths = pid, paths
        self.base, self.disk, self.rss = du(paths), 0, 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.5):
            self.rss = max(self.rss, tree_rss(self.pid))
            self.disk = max(self.disk, du(self.paths) - self.base)


def fresh_copy(workdir: Path, dst: Path, run: str) -> None:
    """The finished run's inputs to extraction and training (its results up to the vocabulary,
    the prepared verifier, Snakemake's records of them; mtimes kept) with this checkout's
    workflow: no stored state, no draft, no cache entry."""
    # Not its logs and benchmark files: a rule this copy does not run (served mode's
    # hidden_states) would be timed by the finished run's file.
    keep = ("prompts", "generate", "synth", "dataset", "vocab", "benchmark_sets.json")
    for name in keep:
        src = workdir / f"results/{run}/{name}"
        if src.is_dir():
            shutil.copytree(src, dst / f"results/{run}/{name}", symlinks=True)
        elif src.exists():
            (dst / f"results/{run}").mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / f"results/{run}/{name}")
    shutil.copytree(workdir / "resources", dst / "resources", symlinks=True)
    if (workdir / ".snakemake/metadata").is_dir():
        shutil.copytree(workdir / ".snakemake/metadata", dst / ".snakemake/metadata")
    copy_workflow(dst)


def run_mode(workdir: Path, scratch: Path, configfiles: list[str], run: str, mode: dict, name: str) -> dict:
    wf = scratch / name
    fresh_copy(workdir, wf, run)
    storage = scratch / f"{name}-transfer"
    storage.mkdir()
    overlay = yaml.safe_load(yaml.safe_dump(mode))
    overlay.setdefault("hidden_states", {}).setdefault("vllm", {})["storage_dir"] = str(storage)
    if overlay["hidden_states"].get("mode") == "served":
        overlay["hidden_states"].setdefault("served", {})["storage_dir"] = str(storage)
    (wf / "mode.yaml").write_text(yaml.safe_dump(overlay))
    cmd = [sys.executable, "-m", "snakemake", "--cores", "all", "--until", "train", "--configfile"]
    cmd += [*configfiles, "mode.yaml"]
    env = {**os.environ, "EAGLEFLOW_OUTPUT_CACHE": "off"}
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=wf, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peaks = Peaks(proc.pid, [wf / "results", storage, Path("/dev/shm")])
    peaks.start()
    out, _ = proc.communicate()
    peaks.stop.set()
    peaks.join()
    wall = time.monotonic() - started
    if proc.returncode != 0:
        raise SystemExit(f"{name}: snakemake failed\n{out[-4000:]}")
    (metrics,) = (wf / f"results/{run}/drafts").glob("*/train/metrics.jsonl")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    train_rows = [r for r in rows if r["split"] == "train"]
    served = next((r for r in rows if r["split"] == "served"), None)
    seconds = {}
    for rule in ("hidden_states", "hidden_states_index", "train"):
        for path in (wf / f"results/{run}/benchmarks").glob(f"{rule}*.tsv"):
            if rule == "hidden_states" and path.name.startswith("hidden_states_index"):
                continue
            seconds[rule] = seconds.get(rule, 0.0) + float(path.read_text().splitlines()[1].split("\t")[0])
    steps = train_rows[-1]["step"]
    return {
        "mode": name,
        "wall_s": round(wall, 1),
        "rule_s": {k: round(v, 1) for k, v in seconds.items()},
        "peak_disk_bytes": peaks.disk,
        "peak_rss_bytes": peaks.rss,
        "steps": steps,
        "train_tokens_per_s": round(sum(r["tokens_per_s"] for r in train_rows) / len(train_rows), 1),
        "served": served,
        "draft": str(next((wf / f"results/{run}/drafts").glob("*/draft"))),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", required=True, type=Path, help="a finished run's directory")
    parser.add_argument("--configfile", nargs="*", default=[], help="the run's config files (besides config.yaml)")
    parser.add_argument("--transfer", default="mooncake", choices=["file", "mooncake"])
    parser.add_argument("--max-inflight-mb", type=float, default=256)
    parser.add_argument("--order", nargs="+", default=["offline", "served"], choices=["offline", "served"])
    parser.add_argument("--out", type=Path, help="where the drafts and the figures are kept")
    args = parser.parse_args()
    configfiles = [str(Path(c).resolve()) for c in args.configfile]
    run = yaml.safe_load((REPO / "config/config.yaml").read_text())["run"]
    for c in configfiles:
        run = (yaml.safe_load(Path(c).read_text()) or {}).get("run", run)
    modes = {
        "offline": {"hidden_states": {"mode": "offline", "backend": "vllm"}},
        "served": {
            "hidden_states": {
                "mode": "served",
                "served": {"transfer": args.transfer, "max_inflight_mb": args.max_inflight_mb},
            }
        },
    }
    results = []
    with tempfile.TemporaryDirectory(prefix="served-states-") as tmp:
        for name in args.order:
            result = run_mode(args.workdir.resolve(), Path(tmp), configfiles, run, modes[name], name)
            print(json.dumps(result), flush=True)
            if args.out:
                args.out.mkdir(parents=True, exist_ok=True)
                shutil.copytree(result["draft"], args.out / name / "draft", dirs_exist_ok=True)
                result["draft"] = str(args.out / name / "draft")
            results.append(result)
    if args.out:
        (args.out / "served_states.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
