"""What every `script:` entry point shares: logging to the rule's log, SIGTERM handling,
the job's GPUs, and the vLLM server spec built from the `server` config section."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import Any

from workflow_scripts.common.gpus import assign_job_gpus
from workflow_scripts.common.server import ServerSpec, terminate_on_sigterm


@contextlib.contextmanager
def stage(snakemake) -> Iterator[logging.Logger]:
    """Run a stage body: log to snakemake.log[0] (stderr too), SIGTERM -> clean exit, and
    disjoint CUDA_VISIBLE_DEVICES for a job that declares `resources: gpu=n`."""
    log_path = snakemake.log[0] if len(snakemake.log) else None
    if log_path:
        sys.stderr = open(log_path, "a", buffering=1)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
    for noisy in ("httpx", "httpx2", "httpcore", "httpcore2", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    terminate_on_sigterm()
    log = logging.getLogger(f"eagleflow.{snakemake.rule}")
    gpus = None
    try:
        gpus = assign_job_gpus(int(snakemake.resources.get("gpu", 0) or 0))
        yield log
    except BaseException:
        log.exception("rule %s failed", snakemake.rule)
        raise
    finally:
        if gpus is not None:
            gpus.release()


def server_spec(server: dict[str, Any], model: str) -> ServerSpec:
    return ServerSpec(
        model=model,
        served_model_name=server.get("served_model_name", "verifier"),
        host=server.get("host", "127.0.0.1"),
        dtype=server["dtype"],
        max_model_len=server.get("max_model_len"),
        tensor_parallel_size=server["tensor_parallel_size"],
        enforce_eager=server.get("enforce_eager", False),
        reasoning_parser=server.get("reasoning_parser"),
        extra_args=tuple(server.get("extra_args") or ()),
        env=dict(server.get("env") or {}),
        startup_timeout_s=server["startup_timeout_s"],
    )
