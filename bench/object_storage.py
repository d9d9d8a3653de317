"""A run with its outputs and stores in a bucket against the same run on a filesystem: each in a
fresh copy of the workflow, one after the other, through the same `snakemake --cores all`;
the bucket is a real S3 server on loopback (SeaweedFS, devkit/seaweedfs.py).

    .venv/bin/python bench/object_storage.py --out DIR [--configfile tests/config/small.yaml] [--order fs s3]

Per mode: the wall time. With S3, per rule: the files Snakemake stored to and retrieved from the
bucket (its log's "Storing in storage" / "Retrieving from storage" lines, sized from the bucket's
listing), and what eagleflow's stores moved (the samples the hidden_states jobs uploaded, the
replies generate and write_prompts published, the states training fetched: from their logs).
Requests count one per object moved, a multipart upload's parts each (8 MB, boto3's default),
plus the listings. Then a second `snakemake -n` on the bucket: the jobs it plans (none is right);
and with `--edit MODULE` (a module of workflow/eagleflow, e.g. synth.py: a corrected generator)
that module edited in both copies, and what `snakemake -n` plans in each, with its reasons.
Writes DIR/object_storage.json. Each mode alone (on a quiet machine: the two at once share
the cores), one call after another into the same DIR: a call keeps the modes of an earlier
one's DIR/object_storage.json that it does not run, and the edit and the ratio come once both
are there (`--order fs`, then `--order s3 --edit MODULE`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "workflow"))
from devkit.runs import copy_workflow, planned_jobs  # noqa: E402
from devkit.seaweedfs import SeaweedFS  # noqa: E402

PART = 8 << 20  # boto3's multipart threshold and part size
SNAKEMAKE = str(Path(sys.executable).with_name("snakemake"))


def run(wf: Path, args: list[str], env: dict[str, str], log: Path) -> float:
    started = time.monotonic()
    with log.open("w") as out:
        done = subprocess.run([SNAKEMAKE, *args], cwd=wf, env=env, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode:
        raise SystemExit(f"snakemake failed ({done.returncode}); see {log}")
    return time.monotonic() - started


def transfers(log: str) -> dict[str, dict[str, list[str]]]:
    """{rule: {"stored": [url], "retrieved": [url]}} from a run's log: storing lines belong to
    the job whose "Finished jobid" follows them, retrievals to the job whose block follows."""
    out: dict[str, dict[str, list[str]]] = defaultdict(lambda: {"stored": [], "retrieved": []})
    stored: list[str] = []
    retrieved: list[str] = []
    for line in log.splitlines():
        if m := re.match(r"Storing in storage: (\S+)", line):
            stored.append(m.group(1))
        elif m := re.match(r"Retrieving from storage: (\S+)", line):
            retrieved.append(m.group(1))
        elif m := re.match(r"(?:local)?rule (\S+):$", line.strip()):
            out[m.group(1)]["retrieved"] += retrieved
            retrieved = []
        elif m := re.search(r"Finished jobid: \d+ \(Rule: (\S+)\)", line):
            out[m.group(1)]["stored"] += stored
            stored = []
    return dict(out)


def sizes(listing: dict[str, int], url: str) -> list[int]:
    """The sizes of the object `url` names, or of each object under it (a directory)."""
    key = url.split("/", 3)[3]
    if key in listing:
        return [listing[key]]
    return [size for k, size in listing.items() if k.startswith(key + "/")]


def requests(object_sizes: list[int]) -> int:
    return sum(max(1, math.ceil(s / PART)) + (1 if s > PART else 0) for s in object_sizes)


def store_traffic(logs: dict[str, str]) -> dict[str, dict[str, float]]:
    """What eagleflow's stores moved, per rule, from its jobs' logs."""
    out: dict[str, dict[str, float]] = {}
    for rule, text in logs.items():
        if m := re.search(r"states from \S+: (\d+) files fetched \(([\d.]+) GB\)", text):
            out[rule] = {"states_fetched": int(m.group(1)), "states_fetched_gb": float(m.group(2))}
    return out


def edited_plans(out: Path, module: str, config: list[str], s3_env: dict[str, str], flags: list[str]) -> dict:
    """`module` edited (a statement appended) in both copies: what `snakemake -n` plans in each,
    {rule: reason}, and whether the two name the same jobs."""
    plans = {}
    for mode, env, extra in (("fs", {**os.environ}, []), ("s3", s3_env, flags)):
        path = out / mode / "workflow/eagleflow" / module
        path.write_text(path.read_text() + "\nEDITED_BY_BENCH = True\n")
        cmd = [SNAKEMAKE, "-n", "--cores", "all", *config, *extra]
        dry = subprocess.run(cmd, cwd=out / mode, env=env, capture_output=True, text=True)
        plans[mode] = planned_jobs(dry.stdout)
    return {"module": module, **plans, "same_jobs": sorted(plans["fs"]) == sorted(plans["s3"])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--configfile", default=None, help="a config over config/config.yaml (default: the demo)")
    parser.add_argument("--order", nargs="+", default=["fs", "s3"], choices=["fs", "s3"])
    parser.add_argument("--edit", help="a module under workflow/eagleflow to edit in both copies afterwards")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    config = ["--configfile", str(Path(args.configfile).resolve())] if args.configfile else []
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    earlier = args.out / "object_storage.json"
    result: dict[str, dict] = {
        mode: found
        for mode, found in (json.loads(earlier.read_text()) if earlier.exists() else {}).items()
        if mode in ("fs", "s3") and mode not in args.order
    }
    server = None
    flags = ["--default-storage-provider", "s3", "--default-storage-prefix", "s3://eagleflow/run"]
    try:
        for mode in args.order:
            wf = copy_workflow(args.out / mode)
            if mode == "fs":
                result["fs"] = {"wall_s": round(run(wf, ["--cores", "all", *config], env, args.out / "fs.log"), 1)}
                continue
            server = SeaweedFS(args.out / "seaweedfs").start()
            s3_env = {**env, **server.env()}
            wall = run(wf, ["--cores", "all", *config, *flags], s3_env, args.out / "s3.log")
            os.environ.update(server.env())
            from eagleflow.runtime.object_store import Bucket

            listing = dict(Bucket("s3://eagleflow").listing())
            per_rule = {}
            for rule, moved in sorted(transfers((args.out / "s3.log").read_text()).items()):
                up = [s for url in moved["stored"] for s in sizes(listing, url)]
                down = [s for url in moved["retrieved"] for s in sizes(listing, url)]
                per_rule[rule] = {
                    "uploaded_bytes": sum(up),
                    "downloaded_bytes": sum(down),
                    "objects": len(up) + len(down),
                    "requests": requests(up) + requests(down),
                }
            stores = {
                prefix: {
                    "objects": sum(1 for k in listing if k.startswith(prefix)),
                    "bytes": sum(s for k, s in listing.items() if k.startswith(prefix)),
                }
                for prefix in ("run/states/", "run/responses/")
            }
            logs = {}
            for key in listing:
                if "/logs/train." in key and key.endswith(".log"):
                    local = args.out / "train-logs" / Path(key).name
                    Bucket("s3://eagleflow").download(key, local)
                    logs[Path(key).stem] = local.read_text()
            again = subprocess.run(
                [SNAKEMAKE, "-n", "--cores", "all", *config, *flags], cwd=wf, env=s3_env, capture_output=True, text=True
            )
            result["s3"] = {
                "wall_s": round(wall, 1),
                "per_rule": per_rule,
                "stores": stores,
                "training": store_traffic(logs),
                "second_run_plans": sorted(planned_jobs(again.stdout)),
            }
        if args.edit and "fs" in result and "s3" in result:
            if server is None:
                raise SystemExit("--edit plans the bucket's copy against its server: run it with the s3 mode")
            result["edit"] = edited_plans(args.out, args.edit, config, s3_env, flags)
    finally:
        if server is not None:
            server.stop()
    if "fs" in result and "s3" in result:
        result["s3_over_fs"] = round(result["s3"]["wall_s"] / result["fs"]["wall_s"], 3)
    (args.out / "object_storage.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
