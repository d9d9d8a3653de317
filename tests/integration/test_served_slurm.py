"""Served mode across two nodes of the test SLURM cluster (tests/slurm/start_cluster.sh: this
host, and a slurmd in a network and UTS namespace of its own, reachable only at its address):
the train job of the shared run's draft goes through the SLURM profile with
`hidden_states.served.placement: nodes`. It asks for two nodes; the trainer (two data-parallel
processes) and the Mooncake master run on the one its batch script lands on, and vLLM's
extraction server on the other, started by `srun` as a step of the same job and bound to that
node's address, one server for both training processes. Every state crosses from one node's
Mooncake client to the other's. When the job ends nothing of it is alive. The same xdist
scope as the other SLURM modules (tests/conftest.py)."""

import json
import re
import subprocess
import uuid

import pytest
import yaml

from tests.helpers import SNAKEMAKE, vllm_processes
from tests.slurm_cluster import SMALL, copy_for_cluster, job_processes, rules_on_two_nodes

RUN = "results/small"
ON_NODES = {
    "hidden_states": {
        "mode": "served",
        "served": {"transfer": "mooncake", "placement": "nodes", "servers": 1, "max_inflight_mb": 4},
    },
    # Its own draft (nothing restored from the output cache), on two processes (gloo).
    "train": {"seed": 7, "nproc_per_node": 2},
}


@pytest.fixture(scope="module")
def on_two_nodes(finished_run, module_tmp):
    wf, profile_dir, env = copy_for_cluster(finished_run, module_tmp)
    rules_on_two_nodes(profile_dir, ["train"])
    (wf / "on-nodes.yaml").write_text(yaml.safe_dump(ON_NODES))
    marker = f"EAGLEFLOW_TEST_SERVED_SLURM={uuid.uuid4().hex}"
    env = {**env, marker.split("=")[0]: marker.split("=")[1]}
    cmd = SNAKEMAKE + ["--until", "train", "--workflow-profile", str(profile_dir)]
    cmd += ["--configfile", str(SMALL), "on-nodes.yaml"]
    proc = subprocess.run(cmd, cwd=wf, env=env, capture_output=True, text=True, timeout=1200)
    out = proc.stderr + proc.stdout
    logs = sorted((wf / f"{RUN}/logs").glob("train.*.log"))
    if proc.returncode != 0:
        tails = "\n".join(f"--- {p}\n{p.read_text()[-3000:]}" for p in [*logs, *(wf / "logs/slurm").rglob("*.log")])
        pytest.fail(f"snakemake on SLURM failed ({proc.returncode}):\n{out[-4000:]}\n{tails}")
    submissions = re.findall(r"submitted with SLURM jobid (\d+) \(log: (\S+)\)", out)
    (job_id,) = [job for job, log in submissions if "rule_train" in log]
    return {"wf": wf, "job_id": job_id, "marker": marker, "train_log": logs[0].read_text()}


@pytest.mark.slurm
@pytest.mark.vllm
def test_the_server_runs_on_the_other_node_and_every_state_crosses(on_two_nodes):
    log = on_two_nodes["train_log"]
    # The launcher names where it put the server: another node, at that node's address.
    found = re.search(r"extraction server 1 of 1 at http://([\d.]+):\d+ on node (\S+)", log)
    assert found, log[-3000:]
    address, server_node = found.groups()
    trainer = re.search(r"starting the Mooncake master on ([\d.]+):\d+", log)
    assert trainer and trainer.group(1) != address, log[-3000:]  # the master: the trainer's node
    assert not address.startswith("127."), address
    (metrics,) = (on_two_nodes["wf"] / f"{RUN}/drafts").glob("*/train/metrics.jsonl")
    (served,) = [r for r in map(json.loads, metrics.read_text().splitlines()) if r["split"] == "served"]
    assert served["transfer"] == "mooncake" and served["received"] == served["requested"] > 0, served
    assert not any(k.startswith(("refused_", "transfer_timeouts")) for k in served), served
    assert server_node in log and list((on_two_nodes["wf"] / f"{RUN}/logs").glob("train.*.served-0.server.log"))


@pytest.mark.slurm
@pytest.mark.vllm
def test_one_server_feeds_both_training_processes_each_sample_once_an_epoch(on_two_nodes):
    """One launch for the job: the first process starts the server, the other attaches. Each
    epoch trains on every sample once (by one process or the other), and each process asks for
    the eval split once: with two epochs and two processes, every sample arrives twice."""
    from eagleflow.runtime.ledger import read_loads
    from eagleflow.train.online import load_token_samples

    wf = on_two_nodes["wf"]
    loads = [(r["kind"], r["shared"]) for r in read_loads(wf / f"{RUN}/logs/servers") if r["stage"] == "train"]
    assert loads == [("start", True)], loads
    assert "using the phase's shared vLLM" in on_two_nodes["train_log"]
    (metrics,) = (wf / f"{RUN}/drafts").glob("*/train/metrics.jsonl")
    (served,) = [r for r in map(json.loads, metrics.read_text().splitlines()) if r["split"] == "served"]
    dataset = wf / f"{RUN}/dataset"
    train, evals = load_token_samples(str(dataset / "train.parquet"), str(dataset / "eval.parquet"), 1.0)
    assert served["processes"] == 2
    assert served["samples_received_times"] == {"2": len(train) + len(evals)}, served


@pytest.mark.slurm
@pytest.mark.vllm
def test_nothing_of_the_job_outlives_it(on_two_nodes):
    """No process of the train job (the server's step on the other node, the master, the
    trainer) is alive once it ended: found by the job's id and this test's marker."""
    assert job_processes(on_two_nodes["job_id"], on_two_nodes["marker"]) == []
    assert vllm_processes(str(on_two_nodes["wf"])) == []
