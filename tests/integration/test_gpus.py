"""Disjoint GPUs for concurrent jobs (profiles/local-gpu, workflow/eagleflow/runtime/gpus.py)."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from eagleflow.runtime.gpus import assign_job_gpus, claim_gpus, device_pool
from tests.helpers import REPO


def test_device_pool_prefers_the_users_restriction(tmp_path):
    for i in (0, 1, 3, 10):
        (tmp_path / f"nvidia{i}").touch()
    (tmp_path / "nvidiactl").touch()
    assert device_pool({}, str(tmp_path)) == ["0", "1", "3", "10"]
    assert device_pool({"CUDA_VISIBLE_DEVICES": "2, 5"}, str(tmp_path)) == ["2", "5"]
    assert device_pool({"CUDA_VISIBLE_DEVICES": ""}, str(tmp_path)) == []


def test_claims_are_disjoint_and_die_with_the_process(tmp_path):
    pool = ["0", "1", "2"]
    first = claim_gpus(2, pool, tmp_path)
    second = claim_gpus(1, pool, tmp_path)
    assert not set(first.devices) & set(second.devices)
    with pytest.raises(RuntimeError, match="could not lock 1 of the GPUs 0,1,2"):
        claim_gpus(1, pool, tmp_path, timeout_s=0.3)
    first.release()
    assert len(claim_gpus(2, pool, tmp_path).devices) == 2

    # A SIGKILLed holder frees its devices: the kernel drops flock locks with the process.
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
            import sys, time
            from pathlib import Path
            from eagleflow.runtime.gpus import claim_gpus
            claim_gpus(1, ["7"], Path({str(tmp_path)!r}))
            print("held", flush=True)
            time.sleep(60)
        """),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(RuntimeError):
        claim_gpus(1, ["7"], tmp_path, timeout_s=0.2)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert claim_gpus(1, ["7"], tmp_path, timeout_s=2).devices == ["7"]


def test_more_gpus_than_the_host_has_is_a_clear_error(tmp_path):
    with pytest.raises(RuntimeError, match="needs 4 GPUs but this host offers 2"):
        claim_gpus(4, ["0", "1"], tmp_path)


def test_slurm_and_cpu_jobs_are_left_alone(monkeypatch):
    env = {"SLURM_JOB_ID": "12", "CUDA_VISIBLE_DEVICES": "3"}
    assert assign_job_gpus(2, env) is None and env["CUDA_VISIBLE_DEVICES"] == "3"
    env = {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert assign_job_gpus(0, env) is None and env["CUDA_VISIBLE_DEVICES"] == "0,1"


JOB_SCRIPT = """
import json, os, time
from eagleflow.runtime.smk import stage

with stage(snakemake):
    start = time.time()
    time.sleep(2.0)
    row = {"devices": os.environ["CUDA_VISIBLE_DEVICES"].split(","), "start": start, "end": time.time(),
           "gpu": snakemake.resources.gpu}
    with open(snakemake.output[0], "w") as f:
        json.dump(row, f)
"""

SNAKEFILE = """
JOBS = {"a": 1, "b": 1, "c": 1, "d": 1, "e": 2, "f": 2, "g": 3}


rule all:
    input:
        expand("seen/{job}.json", job=JOBS),


rule job:
    output:
        "seen/{job}.json",
    log:
        "logs/{job}.log",
    threads: 1
    resources:
        gpu=lambda wildcards: JOBS[wildcards.job],
    script:
        "job.py"
"""


def test_local_gpu_profile_gives_parallel_jobs_disjoint_devices(tmp_path):
    """Seven jobs taking 1, 1, 1, 1, 2, 2 and 3 GPUs on a 4-GPU host, through the real
    profile: every job sees exactly its count, and jobs that overlap in time never share."""
    (tmp_path / "Snakefile").write_text(SNAKEFILE)
    (tmp_path / "job.py").write_text(JOB_SCRIPT)
    pool = ["0", "1", "2", "3"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(pool), "EAGLEFLOW_GPU_LOCK_DIR": str(tmp_path / "locks")}
    env.pop("SLURM_JOB_ID", None)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "snakemake",
            "--workflow-profile",
            str(REPO / "profiles/local-gpu"),
            "--cores",
            "8",
            "--resources",
            "gpu=4",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {p.stem: json.loads(p.read_text()) for p in (tmp_path / "seen").glob("*.json")}
    assert len(rows) == 7
    for name, row in rows.items():
        assert len(row["devices"]) == row["gpu"], (name, row)
        assert len(set(row["devices"])) == row["gpu"] and set(row["devices"]) <= set(pool), (name, row)
    overlapping = 0
    names = sorted(rows)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            ra, rb = rows[a], rows[b]
            if ra["start"] < rb["end"] and rb["start"] < ra["end"]:
                overlapping += 1
                assert not set(ra["devices"]) & set(rb["devices"]), (a, ra, b, rb)
    # Four 1-GPU jobs fit at once: without parallel jobs the test would prove nothing.
    assert overlapping >= 3
