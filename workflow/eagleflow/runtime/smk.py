"""What every `script:` entry point shares: logging to the rule's log, SIGTERM handling,
the job's GPUs and its threads."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator

from eagleflow.runtime.gpus import assign_job_gpus
from eagleflow.runtime.logs import configure_logging
from eagleflow.runtime.process import terminate_on_sigterm
from eagleflow.runtime.response_store import BUCKET_ENV


@contextlib.contextmanager
def stage(snakemake, claim_gpus: bool = True) -> Iterator[logging.Logger]:
    """Run a stage body: log to snakemake.log[0] (stderr too), SIGTERM -> clean exit,
    disjoint CUDA_VISIBLE_DEVICES for a job that declares `resources: gpu=n` (unless the
    stage hands its GPUs to a shared server, which claims them itself), and no more threads
    than the CPUs the job may run on (`--cores all` counts the machine's, not a cgroup's or
    taskset's: two threads spinning on one CPU run at a fraction of one)."""
    log_path = snakemake.log[0] if len(snakemake.log) else None
    if log_path:
        # The job's stderr for the rest of its life: every library's warnings land in the rule log.
        sys.stderr = open(log_path, "a", buffering=1)  # noqa: SIM115
    configure_logging(sys.stderr)
    terminate_on_sigterm()
    log = logging.getLogger(f"eagleflow.{snakemake.rule}")
    # The response store in a bucket (storage.responses), for every store this job opens.
    responses = ((getattr(snakemake, "config", None) or {}).get("storage") or {}).get("responses")
    if responses:
        os.environ[BUCKET_ENV] = responses
    allowed = len(os.sched_getaffinity(0))
    if snakemake.threads > allowed:
        log.info("threads: %d given, %d CPUs this job may run on; using %d", snakemake.threads, allowed, allowed)
        snakemake.threads = allowed
    gpus = None
    try:
        if claim_gpus:
            gpus = assign_job_gpus(int(snakemake.resources.get("gpu", 0) or 0))
        yield log
    except BaseException:
        log.exception("rule %s failed", snakemake.rule)
        raise
    finally:
        if gpus is not None:
            gpus.release()
