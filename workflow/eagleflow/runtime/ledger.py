"""The verifier loads a run took: one line of `<run logs>/servers/loads.jsonl` per server
launch (runtime.vllm_server), read by the run's report (compare). On the target host one load of
Kimi-K2.5 INT4 takes about 22 minutes; eagleflow.dag.plan.loads plans them before a run.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

LOADS_FILE = "loads.jsonl"


def record_load(lease_dir: str | os.PathLike, log_path: Path, model: str, kind: str, shared: bool) -> None:
    """One line of `<lease dir>/loads.jsonl` per server launch: the verifier loads a run took.
    Appended with one write (O_APPEND), so concurrent jobs do not interleave lines."""
    line = {
        "at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "stage": log_path.name.split(".")[0],
        "model": model,
        "kind": kind,  # start or restart
        "shared": shared,
        "log": str(log_path),
    }
    with open(Path(lease_dir) / LOADS_FILE, "a") as fh:
        fh.write(json.dumps(line) + "\n")


def read_loads(lease_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The launches `record_load` wrote under `lease_dir` (none yet: [])."""
    try:
        text = (Path(lease_dir) / LOADS_FILE).read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def count_loads(records: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """stage -> {"start": n, "restart": m} from the launch records. Pure."""
    counts: dict[str, Counter] = {}
    for r in records:
        counts.setdefault(r["stage"], Counter())[r["kind"]] += 1
    return {stage: dict(c) for stage, c in counts.items()}
