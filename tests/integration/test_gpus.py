"""Disjoint GPUs for concurrent jobs through the local-gpu profile (profiles/local-gpu,
workflow/eagleflow/runtime/gpus.py); the claims themselves: tests/unit/test_gpu_claims.py."""

import json
import os
import subprocess
import sys

from tests.helpers import REPO

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
