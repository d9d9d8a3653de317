"""Disjoint GPUs for concurrent jobs (workflow/eagleflow/runtime/gpus.py): the device pool,
claims that exclude each other and die with their process, and jobs left alone. No GPU is
needed: devices are names, claims are file locks."""

import signal
import subprocess
import sys
import textwrap

import pytest

from eagleflow.runtime.gpus import assign_job_gpus, claim_gpus, device_pool


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
