"""Serve the verifier alone and measure it on every benchmark set at each temperature: the
baseline rule, once per run (its workload: benchmark.run's module docstring). Drafts appear
nowhere here, so no draft's code is in the baseline's fingerprint: a method's edit re-measures
its drafts, never the verifier alone."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

from eagleflow.benchmark.cells import HEADLINE
from eagleflow.benchmark.workload import BenchmarkConfig, Workload, run_workload
from eagleflow.common.atomic import write_json
from eagleflow.common.cache_keys import server_stack
from eagleflow.common.config import typed
from eagleflow.runtime.output_cache import reuse_or_make
from eagleflow.runtime.smk import stage
from eagleflow.runtime.spec import ServerConfig, ServerSpec
from eagleflow.runtime.vllm_server import VllmServer

log = logging.getLogger(__name__)


def main_baseline(smk) -> None:
    """The baseline rule's job (workflow/rules/benchmark.smk): the verifier alone, once per run."""
    with stage(smk) as log:
        server = ServerConfig.from_section(smk.config["server"])
        # request_timeout_s is operational: from the config, so that changing it reruns nothing.
        timeout = typed(BenchmarkConfig, smk.config["benchmark"], "benchmark").request_timeout_s
        workload = Workload.from_measured(smk.params.workload, timeout)
        reuse_or_make(
            smk,
            lambda: run_baseline(
                smk.input.sets,
                smk.input.verifier,
                smk.output.report,
                vllm_log_prefix(smk.log[0]),
                server=ServerSpec.from_config(server, smk.input.verifier),
                workload=workload,
            ),
            log,
            server_stack(server.env),
        )


def vllm_log_prefix(rule_log: str) -> str:
    """logs/benchmark.default.log -> logs/benchmark.default.vllm (-baseline.log, -speculative.log)."""
    return str(Path(rule_log).with_suffix("")) + ".vllm"


def read_sets(path: str) -> list[dict[str, Any]]:
    return json.loads(Path(path).read_text())["sets"]


def run_baseline(
    sets_path: str, verifier_dir: str, out: str, log_prefix: str, *, server: ServerSpec, workload: Workload
) -> None:
    """Measure the verifier alone on every set and temperature of `workload` and write it
    (outputs and replies included: every draft's benchmark checks its outputs against them and
    asks later turns with them)."""
    sets = read_sets(sets_path)
    cells = measure(sets, server, workload, f"{log_prefix}-baseline.log", "baseline")
    head = cells[HEADLINE]
    write_json(
        out,
        {
            "verifier": verifier_dir,
            "sets": sets_path,
            "prompts": {"count": len(head["prompts"]), "ids": head["prompts"]},
            "workload": dataclasses.asdict(workload),
            "server": server_summary(server),
            **{key: head[key] for key in ("output_tokens", "wall_s", "output_tokens_per_s")},
            "cells": {
                key: {k: v for k, v in cell.items() if k not in ("streams", "counters")} for key, cell in cells.items()
            },
        },
    )
    for key, cell in cells.items():
        log.info("baseline %s: %.1f output tok/s over %d requests", key, cell["output_tokens_per_s"], cell["requests"])


def measure(
    sets: list[dict[str, Any]],
    spec: ServerSpec,
    workload: Workload,
    log_path: str,
    label: str,
    context: dict[str, dict[str, list[str]]] | None = None,
) -> dict[str, dict[str, Any]]:
    with VllmServer(spec, log_path) as srv:
        return asyncio.run(run_workload(srv.base_url, sets, workload, spec.served_model_name, label, context))


def server_summary(server: ServerSpec) -> dict[str, Any]:
    return {
        "dtype": server.dtype,
        "enforce_eager": server.enforce_eager,
        "tensor_parallel_size": server.tensor_parallel_size,
    }
