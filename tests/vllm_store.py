"""The vLLM backend's store on a copy of the finished run, built once per pytest session
(tests/integration/conftest.py: vllm_store) for the modules that read it: the extraction's
kill and resume (test_vllm_extraction.py) and the offline reference that served mode is
held to (test_served_states.py, test_served_mooncake.py).

One run of the phase's job (one per node; its own server), storing every few samples: its
vLLM is SIGKILLed as it starts extracting (it is restarted, the job goes on), then the job
itself is SIGKILLed once the store holds some of its samples. Then the same command again:
the rerun extracts only what the killed job had not stored. What the kills left is kept in
`kills.json` beside the copy. Then the draft trained on that store (`--until train`: no
server), the reference a draft trained on served states must equal.

One request in flight (concurrency 1, no adaptive concurrency): vLLM on a CPU then prefills
each sample alone, as the same GEMM shapes on both sides, so served states are the same bits
(with 32 requests offline against 8 served, a final state here differed in its last bits).
The states are stored in float32: test_vllm_extraction compares them with transformers'
float32 states, and served mode keeps them in the same dtype."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import yaml

from devkit.configs import merged
from devkit.runs import copy_finished_run
from eagleflow.runtime.ledger import read_loads
from eagleflow.runtime.process import group_members, parent_pid
from tests.helpers import REPO, SNAKEMAKE

SMALL = REPO / "tests/config/small.yaml"
RUN = "results/small"
INDEX = f"{RUN}/hidden_states/index.json"
PART = f"{RUN}/hidden_states/part-00000.json"
# Tokens between two writes to the store: a few samples of the small run at a time.
STORE_EVERY_TOKENS = 600
# A checkpoint every few of the run's 20 steps: test_served_states' kill lands after one. The
# same in the reference, so that the two trainings match step for step.
REFERENCE_TRAINING = {"train": {"checkpoint_every": 4}}
DTYPE = "float32"


def verifier_name() -> str:
    return yaml.safe_load((REPO / "config/config.yaml").read_text())["verifier"]["name"]


def serve_path(finished_run: Path) -> str:
    """The verifier by the original run's path: the drafts name it so (as test_slurm keeps)."""
    return str((finished_run / "resources/verifier" / verifier_name()).resolve())


def vllm_backend_config(serve_path: str, storage: Path) -> dict:
    return {
        "verifier": {"serve_path": serve_path},
        "hidden_states": {
            "backend": "vllm",
            "num_parts": 1,
            "store_every_tokens": STORE_EVERY_TOKENS,
            "dtype": DTYPE,
            # One request in flight: a killed job leaves at most one unread file.
            "vllm": {"concurrency": 1, "adaptive_concurrency": False, "storage_dir": str(storage)},
        },
    }


def part_log(wf: Path) -> Path:
    return wf / f"{RUN}/logs/hidden_states.part-00000.log"


def extracting(wf: Path) -> bool:
    """Whether the part's job has its server healthy and is extracting."""
    log = part_log(wf)
    return log.exists() and "healthy" in log.read_text()


def lease(wf: Path) -> dict | None:
    """The lease of the run's one vLLM server (runtime.leases): its process group and its owner."""
    for path in (wf / f"{RUN}/logs/servers").glob("vllm-*.json"):
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
    return None


def kill_vllm(wf: Path) -> int | None:
    """SIGKILL the job's vLLM API server (its supervisor's child), as the OOM killer would."""
    held = lease(wf)
    if held:
        for pid in group_members(held["pgid"]):
            if parent_pid(pid) == held["pgid"]:
                os.kill(pid, signal.SIGKILL)
                return pid
    return None


def stored(wf: Path) -> set[str]:
    """The store's sample files: `<key[:2]>/<key>.safetensors`, not a write a kill cut short
    (the temporary directory it leaves beside them holds a file of that name too)."""
    return {p.name for p in (wf / f"{RUN}/hidden_states/samples").glob("*/*.safetensors")}


class StorageWatch(threading.Thread):
    """The most states files the storage directory held at any time."""

    def __init__(self, storage: Path):
        super().__init__(daemon=True)
        self.storage, self.most, self.stop = storage, 0, threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.02):
            self.most = max(self.most, len(list(self.storage.rglob("*.safetensors"))))


def build_vllm_store(finished_run: Path, wf: Path) -> str | None:
    """The store, the kills and the reference draft into `wf` (a copy of `finished_run`), as
    the module docstring says; the failure's message, or None."""
    copy_finished_run(finished_run, wf)
    storage = wf / "hs-storage"
    config = vllm_backend_config(serve_path(finished_run), storage)
    (wf / "vllm.yaml").write_text(yaml.safe_dump(config))
    cmd = SNAKEMAKE + [INDEX, "--cores", "2", "--configfile", str(SMALL), "vllm.yaml"]
    loads_before = len(read_loads(wf / f"{RUN}/logs/servers"))
    part_log(wf).unlink(missing_ok=True)  # the shared run's, which says "healthy" too
    before = stored(wf)  # the shared run's states (the hf backend: other keys)
    watch = StorageWatch(storage)
    watch.start()
    first = subprocess.Popen(cmd, cwd=wf, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    server_killed = job_killed = None
    at_server_kill: set[str] = set()
    deadline = time.monotonic() + 900
    while job_killed is None and first.poll() is None and time.monotonic() < deadline:
        if server_killed is None and extracting(wf):
            server_killed = kill_vllm(wf)
            at_server_kill = stored(wf) - before
        # Once the restarted server has stored more: kill the job mid-part.
        elif server_killed and len(stored(wf) - before - at_server_kill) >= 2 and (held := lease(wf)):
            os.kill(held["owner_pid"], signal.SIGKILL)
            job_killed = held["owner_pid"]
        time.sleep(0.02)
    first_out = first.communicate(timeout=900)[0]
    first_log = part_log(wf).read_text()
    stored_at_kill = stored(wf) - before
    loads_first = read_loads(wf / f"{RUN}/logs/servers")[loads_before:]
    part_after_kill = (wf / PART).exists()
    rerun = subprocess.run(cmd, cwd=wf, capture_output=True, text=True, timeout=900)
    watch.stop.set()
    watch.join()
    kills = {
        "storage": str(storage),
        "server_killed": server_killed,
        "job_killed": job_killed,
        "first_rc": first.returncode,
        "first_out": first_out,
        "first_log": first_log,
        "stored_at_kill": sorted(stored_at_kill),
        "part_after_kill": part_after_kill,
        "loads_first": loads_first,
        "loads_rerun": read_loads(wf / f"{RUN}/logs/servers")[loads_before + len(loads_first) :],
        "rerun": {"returncode": rerun.returncode, "stderr": rerun.stderr},
        "most_files": watch.most,
    }
    (wf / "kills.json").write_text(json.dumps(kills))
    if rerun.returncode != 0:
        return f"the rerun of the killed extraction failed ({rerun.returncode}):\n{rerun.stderr[-4000:]}"
    # The reference draft, on the same hidden_states section: only train runs.
    (wf / "reference.yaml").write_text(yaml.safe_dump(merged(config, REFERENCE_TRAINING)))
    train = subprocess.run(
        SNAKEMAKE + ["--cores", "2", "--configfile", str(SMALL), "reference.yaml", "--until", "train"],
        cwd=wf,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if train.returncode != 0:
        return f"the reference draft's training failed ({train.returncode}):\n{train.stderr[-4000:]}"
    return None


def kills(store: Path) -> dict:
    """What build_vllm_store recorded of its kills and rerun."""
    return json.loads((store / "kills.json").read_text())
