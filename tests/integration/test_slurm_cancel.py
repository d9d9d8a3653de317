"""A cancelled job on the test SLURM cluster (tests/slurm/start_cluster.sh) is dead, every
process of it: also one that left the job's process tree, as a daemonized child does (and as a
SIGKILLed shard's inner Snakemake did when its parent died first). Found by environment
(tests/slurm_cluster.py: job_processes), never by name."""

import os
import subprocess
import uuid

import pytest

from tests.slurm_cluster import cluster_env, job_processes, start_cluster, wait_until_no_process_of

# Runs in the job: a child that leaves the job's process tree (started by a subshell that exits
# at once, so init adopts it; setsid: a session of its own), then the job waits to be cancelled.
# Under proctrack/linuxproc without the test cluster's Epilog the first sleep outlived
# `scancel --signal=KILL --full`.
ESCAPING_JOB = "(setsid sleep 900 < /dev/null > /dev/null 2>&1 &); sleep 900"


@pytest.mark.slurm
def test_a_cancelled_job_leaves_no_process_alive_not_even_one_outside_its_process_tree(tmp_path):
    partition = start_cluster()
    marker = f"EAGLEFLOW_TEST_JOB={uuid.uuid4().hex}"
    env = cluster_env() | dict([marker.split("=", 1)])
    submit = ["sbatch", "--parsable", f"--partition={partition}", "--mem=100", f"--chdir={tmp_path}"]
    job_id = (
        subprocess.run([*submit, "--wrap", ESCAPING_JOB], env=env, capture_output=True, text=True, check=True)
        .stdout.strip()
        .split(";")[0]
    )
    try:
        started = wait_for_processes(job_id, marker, at_least=2)
        assert len(started) >= 2, f"job {job_id} never started both processes: {started}"
        subprocess.run(["scancel", "--signal=KILL", "--full", job_id], check=True)
        alive = wait_until_no_process_of(job_id, marker)
        assert not alive, f"processes of cancelled job {job_id} still alive:\n" + "\n".join(alive)
    finally:
        for line in job_processes(job_id, marker):
            os.kill(int(line.split()[0]), 9)


def wait_for_processes(job_id: str, marker: str, at_least: int, timeout_s: float = 60.0) -> list[str]:
    """The job's processes once at least `at_least` of them run (both sleeps), or at the timeout."""
    import time

    deadline = time.monotonic() + timeout_s
    while len(found := [p for p in job_processes(job_id, marker) if "sleep 900" in p]) < at_least:
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return found
