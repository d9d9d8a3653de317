"""generate in shards on the test SLURM cluster (tests/slurm_cluster.py), from a copy of the
shared run: two shard jobs, each its own sbatch, one SIGKILLed mid-way by `scancel` (and
then no process of it alive, found by environment); the rerun
resubmits that shard alone, which sends only the requests its store file lacks, and the
joined replies equal one job's, request for request.

The requests go to devkit/fake_openai.py: a shard must still be sending when it is killed,
and the fake server's exact latency (1 s a reply, two requests in flight) holds each shard
on the one-node cluster for several seconds, where the small verifier in vLLM answers all of
them at once. The replies' path through the store, the shards and the join is the same for any
server. `generate.max_tokens` differs from the shared run's so that every request is new,
and nothing before generate reruns. The same xdist scope as test_slurm.py
(tests/conftest.py): the one-node cluster runs one run at a time."""

import json
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from devkit.fake_openai import fake_openai_server as fake_openai
from eagleflow.common.replies import read_replies
from tests.helpers import SNAKEMAKE, stored_replies
from tests.slurm_cluster import SMALL, copy_for_cluster, wait_until_no_process_of

RUN = "results/small"
TARGET = f"{RUN}/generate/replies.parquet"
SHARDS = ("0-of-2", "1-of-2")


def rows(path) -> list[tuple]:
    return [(r["id"], r["key"], json.dumps(r["request"]), json.dumps(r["response"])) for r in read_replies(path)]


def slurm_job(comment: str, run_id: str | None = None) -> tuple[str, str] | None:
    """(job id, state) of the newest job with `comment` (rule and wildcards), if any."""
    out = subprocess.run(["squeue", "-h", "--states=all", "-o", "%i|%k|%T|%j"], capture_output=True, text=True)
    found = [
        line.split("|")
        for line in out.stdout.splitlines()
        if line.split("|")[1] == comment and (run_id is None or line.split("|")[3] == run_id)
    ]
    return (found[-1][0], found[-1][2]) if found else None


@pytest.fixture(scope="module")
def sharded(finished_run, module_tmp):
    wf, profile_dir, env = copy_for_cluster(finished_run, module_tmp)
    # Every process of the run carries it, and so every process of its SLURM jobs.
    marker = f"EAGLEFLOW_TEST_JOB={uuid.uuid4().hex}"
    env = env | dict([marker.split("=", 1)])
    store = wf / f"{RUN}/generate/store.sqlite"
    vllm_replies = wf / f"{RUN}/generate/vllm-replies.parquet"
    (wf / TARGET).rename(vllm_replies)
    with fake_openai("--latency", "1", "--lifetime", "900") as url:
        # Requests the shared run never sent (its max_tokens is smaller); 2 in flight per shard.
        fake = {
            "server": {"endpoint": url},
            "generate": {"max_tokens": 60, "concurrency": 2, "adaptive_concurrency": False},
        }

        def snakemake(shards: int, *args: str, concurrency: int = 2) -> subprocess.Popen:
            # How many requests are in flight changes no request: nothing restales.
            generate = fake["generate"] | {"shards": shards, "concurrency": concurrency}
            (wf / "fake.yaml").write_text(yaml.safe_dump(fake | {"generate": generate}))
            cmd = SNAKEMAKE + [TARGET, "--configfile", str(SMALL), "fake.yaml", *args]
            return subprocess.Popen(cmd, cwd=wf, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

        # One job, on this machine: the replies every sharded run must equal.
        one = snakemake(1, "--cores", "2", concurrency=16)
        out, _ = one.communicate(timeout=600)
        assert one.returncode == 0, out[-4000:]
        one_job = rows(wf / TARGET)
        # Its replies leave the store again (the product's prune: keep the shared run's and
        # the written prompts'), so that the shards must ask for every one of them.
        keep = [str(vllm_replies), str(wf / f"{RUN}/prompts/written.jsonl")]
        prune = [sys.executable, "-m", "eagleflow.generate", "prune", str(store), "--keep", *keep]
        subprocess.run(prune, cwd=wf, check=True, capture_output=True)

        # Two shards through SLURM; shard 1 SIGKILLed once it has stored three replies.
        run = snakemake(2, "--workflow-profile", str(profile_dir), "--keep-going")
        shard_store = wf / f"{RUN}/generate/store.1-of-2.sqlite"
        deadline = time.monotonic() + 600
        while stored_replies(shard_store) < 3:
            assert run.poll() is None and time.monotonic() < deadline, "shard 1-of-2 never got going"
            time.sleep(0.2)
        job = slurm_job("rule_generate_wildcards_1-of-2")
        assert job and job[1] == "RUNNING", job
        subprocess.run(["scancel", "--signal=KILL", "--full", job[0]], check=True)
        # Killed means dead, every process of the shard (its inner Snakemake too), before the
        # rerun: one left alive would still send requests and write to the store beside it.
        alive = wait_until_no_process_of(job[0], marker)
        assert not alive, f"processes of the killed shard (job {job[0]}) still alive:\n" + "\n".join(alive)
        first, _ = run.communicate(timeout=600)
        assert run.returncode != 0, "the run survived its killed shard"
        stored_at_kill = stored_replies(shard_store)
        killed = wf / f"{RUN}/generate/shards/1-of-2/stats.json"
        assert not killed.exists(), "the killed shard left its outputs"
        # The rerun: what the kill left undone, on SLURM again.
        rerun = snakemake(2, "--workflow-profile", str(profile_dir))
        second, _ = rerun.communicate(timeout=900)
        assert rerun.returncode == 0, second[-5000:]
    return wf, one_job, first, second, stored_at_kill, job[0]


def submissions(out: str) -> list[str]:
    """The rule/wildcards of every job a Snakemake run submitted, from its SLURM log paths."""
    return [
        "/".join(Path(log).parts[-3:-1])
        for _, log in re.findall(r"submitted with SLURM jobid (\d+) \(log: (\S+)\)", out)
    ]


@pytest.mark.slurm
def test_each_shard_is_its_own_sbatch_and_the_killed_one_is_resubmitted_alone(sharded):
    _, _, first, second, _, killed_id = sharded
    assert sorted(submissions(first)) == ["rule_generate/0-of-2", "rule_generate/1-of-2"]
    # The rerun: the killed shard again (then the join); the finished shard stays done.
    again = submissions(second)
    assert again[0] == "rule_generate/1-of-2" and not [job for job in again if "0-of-2" in job], second[-3000:]
    ids = {}
    for part in SHARDS:
        job = slurm_job(f"rule_generate_wildcards_{part}")
        assert job and job[1] == "COMPLETED", (part, job)
        ids[part] = job[0]
    assert len(set(ids.values())) == 2 and killed_id not in ids.values(), ids


@pytest.mark.slurm
def test_the_killed_shards_rerun_sends_only_what_its_store_lacked_and_the_join_is_one_jobs_replies(sharded):
    wf, one_job, _, _, stored_at_kill, _ = sharded
    shard = json.loads((wf / f"{RUN}/generate/shards/1-of-2/stats.json").read_text())
    assert 3 <= stored_at_kill < shard["requests"], (stored_at_kill, shard)
    assert shard["reused"] == stored_at_kill and shard["sent"] == shard["requests"] - stored_at_kill
    other = json.loads((wf / f"{RUN}/generate/shards/0-of-2/stats.json").read_text())
    assert other["sent"] == other["requests"] and other["reused"] == 0
    joined = json.loads((wf / f"{RUN}/generate/stats.json").read_text())
    assert (
        joined["requests"] == len(one_job)
        and joined["conversations"] == shard["conversations"] + other["conversations"]
    )
    assert rows(wf / TARGET) == one_job
