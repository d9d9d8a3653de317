"""Serve the verifier alone (the baseline rule, once per run) and with a variant's draft (the
benchmark rule), run the held-out prompts at temperature 0 on each, and write report.json.

Both measurements use the same prompts, sampling, concurrency and server flags; only
`--speculative-config` differs. With `benchmark.paired_baseline` each draft's job measures
the verifier alone itself, right before, for speedups on a machine whose speed drifts.
Acceptance comes from vLLM's own counters, as deltas around the measured workload (a warm-up
request runs first and is not counted).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from workflow_scripts.benchmark.metrics import acceptance, counter_delta, spec_decode_counters
from workflow_scripts.common.atomic import read_jsonl, write_json, write_jsonl
from workflow_scripts.common.config import typed
from workflow_scripts.common.output_cache import reuse_or_make
from workflow_scripts.runtime.client import ChatClient
from workflow_scripts.runtime.launch import VllmServer
from workflow_scripts.runtime.smk import stage
from workflow_scripts.runtime.spec import ServerConfig, ServerSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BenchmarkConfig:
    """The `benchmark` config section."""

    num_speculative_tokens: int
    num_prompts: int
    max_tokens: int
    concurrency: int
    request_timeout_s: float
    paired_baseline: bool


@dataclass(frozen=True)
class Workload:
    """What is measured: the first `num_prompts` held-out prompts, greedy, `max_tokens` each,
    `concurrency` at a time, formatted by the chat template as synth formatted the training
    prompts (`generate.chat_template_kwargs`: a thinking verifier's draft is measured thinking).
    The verifier alone is measured once per workload."""

    num_prompts: int
    max_tokens: int
    concurrency: int
    request_timeout_s: float
    chat_template_kwargs: dict[str, Any]

    @classmethod
    def of(cls, cfg: BenchmarkConfig, chat_template_kwargs: dict[str, Any]) -> Workload:
        return cls(cfg.num_prompts, cfg.max_tokens, cfg.concurrency, cfg.request_timeout_s, chat_template_kwargs)


def main_baseline(smk) -> None:
    """The baseline rule's job (rules/benchmark.smk): the verifier alone, once per run."""
    with stage(smk) as log:
        server = ServerConfig.from_section(smk.config["server"])
        # request_timeout_s is operational: from the config, so that changing it reruns nothing.
        workload = Workload(**smk.params.workload, request_timeout_s=smk.config["benchmark"]["request_timeout_s"])
        reuse_or_make(
            smk,
            lambda: run_baseline(
                smk.input.prompts,
                smk.input.verifier,
                smk.output.report,
                vllm_log_prefix(smk.log[0]),
                server=ServerSpec.from_config(server, smk.input.verifier),
                workload=workload,
            ),
            log,
        )


def main(smk) -> None:
    """The benchmark rule's job (rules/benchmark.smk): one variant's draft in vLLM."""
    with stage(smk) as log:
        server = ServerConfig.from_section(smk.config["server"])
        reuse_or_make(
            smk,
            lambda: run_benchmark(
                smk.input.prompts,
                smk.input.verifier,
                smk.input.draft,
                smk.output.report,
                vllm_log_prefix(smk.log[0]),
                server=ServerSpec.from_config(server, smk.input.verifier),
                cfg=typed(BenchmarkConfig, smk.params.benchmark, "benchmark"),
                chat_template_kwargs=smk.params.chat_template_kwargs,
                baseline=smk.input.baseline or None,
                streams_out=smk.output.streams,
            ),
            log,
        )


def vllm_log_prefix(rule_log: str) -> str:
    """logs/benchmark.default.log -> logs/benchmark.default.vllm (-baseline.log, -speculative.log)."""
    return str(Path(rule_log).with_suffix("")) + ".vllm"


def first_turn_messages(prompt: dict[str, Any]) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": prompt["system"]}] if prompt.get("system") else []
    return messages + [{"role": "user", "content": prompt["turns"][0]}]


async def run_workload(base_url: str, prompts: list[dict], cfg: Workload, model: str, label: str) -> dict[str, Any]:
    sampling = {"max_tokens": cfg.max_tokens, "temperature": 0.0, "return_token_ids": True}
    if cfg.chat_template_kwargs:
        sampling["chat_template_kwargs"] = cfg.chat_template_kwargs
    async with ChatClient(base_url, concurrency=cfg.concurrency, request_timeout_s=cfg.request_timeout_s) as client:
        warmup = {
            "model": model,
            "messages": first_turn_messages(prompts[0]),
            **sampling,
            "max_tokens": 8,
        }
        await client.chat(warmup)
        before = spec_decode_counters(await client.get_text("/metrics"))
        sem = asyncio.Semaphore(cfg.concurrency)
        bar = tqdm(total=len(prompts), desc=f"benchmark {label}", unit="req", mininterval=2.0)

        async def one(prompt):
            async with sem:
                body = await client.chat({"model": model, "messages": first_turn_messages(prompt), **sampling})
            bar.update()
            return body.get("prompt_token_ids") or [], body["choices"][0].get("token_ids") or []

        started = time.perf_counter()
        streams = await asyncio.gather(*(one(p) for p in prompts))
        wall = time.perf_counter() - started
        bar.close()
        after = spec_decode_counters(await client.get_text("/metrics"))
    outputs = [output for _, output in streams]
    tokens = sum(len(o) for o in outputs)
    return {
        "outputs": outputs,
        "streams": [
            {"id": p["id"], "prompt_token_ids": prompt_ids, "token_ids": output}
            for p, (prompt_ids, output) in zip(prompts, streams, strict=True)
        ],
        "wall_s": wall,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall,
        "counters": counter_delta(before, after),
    }


def identical_fraction(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of prompts whose greedy outputs are token-for-token equal. Pure."""
    return sum(x == y for x, y in zip(a, b, strict=True)) / max(1, len(a))


def run_baseline(
    prompts_path: str, verifier_dir: str, out: str, log_prefix: str, *, server: ServerSpec, workload: Workload
) -> None:
    """Measure the verifier alone on `workload` and write it (outputs included, for the
    identical-output check of every draft's benchmark)."""
    prompts = read_jsonl(prompts_path)[: workload.num_prompts]
    result = measure(prompts, server, workload, f"{log_prefix}-baseline.log", "baseline")
    write_json(
        out,
        {
            "verifier": verifier_dir,
            "prompts": {"path": prompts_path, "count": len(prompts), "ids": [p["id"] for p in prompts]},
            "workload": dataclasses.asdict(workload),
            "server": server_summary(server),
            **{key: result[key] for key in ("output_tokens", "wall_s", "output_tokens_per_s", "outputs")},
        },
    )
    log.info("baseline: %.1f output tok/s over %d prompts", result["output_tokens_per_s"], len(prompts))


def measure(prompts: list[dict], spec: ServerSpec, workload: Workload, log_path: str, label: str) -> dict[str, Any]:
    with VllmServer(spec, log_path) as srv:
        return asyncio.run(run_workload(srv.base_url, prompts, workload, spec.served_model_name, label))


def server_summary(server: ServerSpec) -> dict[str, Any]:
    return {
        "dtype": server.dtype,
        "enforce_eager": server.enforce_eager,
        "tensor_parallel_size": server.tensor_parallel_size,
    }


def run_benchmark(
    prompts_path: str,
    verifier_dir: str,
    draft_dir: str,
    out: str,
    log_prefix: str,
    *,
    server: ServerSpec,
    cfg: BenchmarkConfig,
    chat_template_kwargs: dict[str, Any],
    baseline: str | None,
    streams_out: str,
) -> None:
    """Serve the verifier with the draft and compare with the verifier alone: the baseline
    job's measurement (`baseline`), or, with benchmark.paired_baseline, one taken in this job
    right before. The speculative run's token streams (prompt and output ids per prompt) go
    to `streams_out`, for the parity rule's replay."""
    workload = Workload.of(cfg, chat_template_kwargs)
    prompts = read_jsonl(prompts_path)[: cfg.num_prompts]
    k = cfg.num_speculative_tokens
    if baseline is None:
        base = measure(prompts, server, workload, f"{log_prefix}-baseline.log", "baseline")
        base_source = "paired: measured in this job, right before the draft"
    else:
        base = json.loads(Path(baseline).read_text())
        if base["prompts"]["ids"] != [p["id"] for p in prompts]:
            raise ValueError(f"{baseline} measured other prompts than this benchmark; rerun the baseline rule")
        base_source = f"the run's baseline job ({baseline})"
    speculative_spec = dataclasses.replace(
        server,
        speculative_config={"method": "eagle3", "model": str(Path(draft_dir).resolve()), "num_speculative_tokens": k},
    )
    spec = measure(prompts, speculative_spec, workload, f"{log_prefix}-speculative.log", "speculative")
    log.info("speculative: %.1f output tok/s over %d prompts", spec["output_tokens_per_s"], len(prompts))
    acc = acceptance(spec["counters"], k)
    report = {
        "verifier": verifier_dir,
        "draft": draft_dir,
        "prompts": {"path": prompts_path, "count": len(prompts), "ids": [p["id"] for p in prompts]},
        "num_speculative_tokens": k,
        "sampling": {"temperature": 0.0, "max_tokens": cfg.max_tokens, "concurrency": cfg.concurrency},
        "server": server_summary(server),
        "baseline": {key: base[key] for key in ("output_tokens", "wall_s", "output_tokens_per_s")},
        "baseline_measurement": base_source,
        "speculative": {**{key: spec[key] for key in ("output_tokens", "wall_s", "output_tokens_per_s")}, **acc},
        "speedup": spec["output_tokens_per_s"] / base["output_tokens_per_s"],
        "outputs_identical_fraction": identical_fraction(base["outputs"], spec["outputs"]),
    }
    write_jsonl(streams_out, spec["streams"])
    write_json(out, report)
    log.info(
        "mean acceptance length %.3f, per position %s, speedup %.2fx (baseline: %s), identical outputs %.0f%%",
        acc["mean_acceptance_length"],
        [round(x, 3) for x in acc["per_position_acceptance"]],
        report["speedup"],
        base_source,
        100 * report["outputs_identical_fraction"],
    )
