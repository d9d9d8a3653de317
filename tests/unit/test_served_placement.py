"""Where served mode's servers go (train/served_servers.py, runtime/slurm_nodes.py) and whether
they fit beside the trainer on one host (dag/plan/fit.py). The two-node run itself:
tests/integration/test_served_slurm.py."""

import asyncio

import pytest

from eagleflow.dag.plan.fit import memory_utilization, side_by_side
from eagleflow.dag.plan.needs import load_merged_config
from eagleflow.dag.variants import merged
from eagleflow.runtime.recovery import ByUrl, Recovery
from eagleflow.runtime.slurm_nodes import Node, PlacementError, allocation, node_addresses, srun_prefix
from eagleflow.train.served_servers import split_gpus
from tests.helpers import REPO

CONFIG = load_merged_config([], REPO)

GB = 10**9


def test_node_addresses_are_read_from_scontrol_one_line_per_node():
    out = (
        "NodeName=vm Arch=x86_64 CoresPerSocket=1 NodeAddr=10.77.0.1 NodeHostName=vm Version=22.05\n"
        "NodeName=eagleflow-n2 Arch=x86_64 NodeAddr=10.77.0.2 NodeHostName=eagleflow-n2\n"
        "garbage without the fields\n"
    )
    assert node_addresses(out) == {"vm": "10.77.0.1", "eagleflow-n2": "10.77.0.2"}


def test_a_step_on_another_node_drops_the_inherited_step_settings_and_keeps_the_job():
    env = {"SLURM_JOB_ID": "7", "SLURM_NNODES": "1", "SLURM_CPUS_PER_TASK": "2", "SRUN_CPUS_PER_TASK": "2", "HOME": "/"}
    argv = srun_prefix("7", Node("n2", "10.0.0.2"), "eagleflow-served-0", env)
    assert argv[0] == "env" and argv.index("srun") > 0
    unset = argv[1 : argv.index("srun")]
    assert unset == ["-u", "SLURM_CPUS_PER_TASK", "-u", "SLURM_NNODES", "-u", "SRUN_CPUS_PER_TASK"]
    flags = argv[argv.index("srun") + 1 :]
    assert "--jobid=7" in flags and "--nodelist=n2" in flags and "--nodes=1" in flags and "--overlap" in flags


def test_placement_on_nodes_outside_slurm_says_what_to_do():
    with pytest.raises(PlacementError, match="outside SLURM.*profiles/slurm"):
        allocation({"PATH": "/usr/bin"})


def test_the_job_gpus_split_servers_last_training_first():
    split = split_gpus(2, 2, {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5"})
    assert split == {"servers": ["2,3", "4,5"], "train": "0,1"}
    with pytest.raises(PlacementError, match="take 4 GPUs.*holds 3"):
        split_gpus(2, 2, {"CUDA_VISIBLE_DEVICES": "0,1,2"})


class Counted(Recovery):
    def __init__(self):
        self.seen = []

    async def recover(self, url: str, cause: str) -> bool:
        self.seen.append(url)
        self.restarts += 1
        return True


def test_each_replica_is_recovered_by_its_own_recovery():
    a, b = Counted(), Counted()
    by_url = ByUrl({"http://a:1/": a, "http://b:2": b})
    assert asyncio.run(by_url.recover("http://b:2", "refused"))
    assert (a.seen, b.seen, by_url.restarts) == ([], ["http://b:2"], 1)


def test_the_vllm_memory_share_is_read_in_either_spelling():
    assert memory_utilization([]) == 0.9
    assert memory_utilization(["--trust-remote-code", "--gpu-memory-utilization", "0.92"]) == 0.92
    assert memory_utilization(["--device-memory-utilization=0.5"]) == 0.5


def kimi_like(**served) -> dict:
    """One 8-GPU host whose verifier fills it (config/kimi-k2.5-8xgpu.yaml's server)."""
    return merged(
        CONFIG,
        {
            "server": {"gpus": 8, "tensor_parallel_size": 8, "extra_args": ["--gpu-memory-utilization", "0.92"]},
            "train": {"nproc_per_node": 8},
            "hidden_states": {"mode": "served", "served": served},
        },
    )


def test_the_seed_hosts_verifier_leaves_too_little_for_the_trainer():
    fit = side_by_side(kimi_like(), weights=594 * GB, train_bytes=20 * GB, gpu_memory=141 * GB, host_gpus=8)
    assert not fit.fits and "leaving 11.3 GB against training's 20.0 GB" in fit.detail
    # A trainer that fits in what vLLM leaves shares the GPUs.
    small = side_by_side(kimi_like(), weights=594 * GB, train_bytes=10 * GB, gpu_memory=141 * GB, host_gpus=8)
    assert small.fits
    # A host with GPUs for both: they fit apart, whatever the memory.
    apart = side_by_side(kimi_like(), weights=594 * GB, train_bytes=200 * GB, gpu_memory=141 * GB, host_gpus=16)
    assert apart.fits and "of their own" in apart.detail
    # Servers it does not launch: no verdict.
    named = kimi_like(endpoints=["http://10.0.0.2:8000"])
    assert side_by_side(named, weights=594 * GB, train_bytes=1, gpu_memory=141 * GB, host_gpus=8) is None


def test_equally_busy_replicas_take_requests_in_turn():
    from eagleflow.runtime.client import ChatClient

    client = ChatClient(["http://127.0.0.1:1", "http://127.0.0.1:2"], concurrency=1, request_timeout_s=1.0)
    assert sorted(client._pick(None) for _ in range(4)) == [0, 0, 1, 1]
    client._in_flight[0] = 3  # the busier one is left alone
    assert {client._pick(None) for _ in range(3)} == {1}
    assert client._pick(1) == 0  # a retry avoids the replica it saw fail
