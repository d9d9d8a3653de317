"""Serve the verifier without and then with the draft, run the held-out prompts at
temperature 0 on each, and write report.json.

Both runs use the same prompts, sampling, concurrency and server flags; only
`--speculative-config` differs. Acceptance comes from vLLM's own counters, as deltas around
the measured workload (a warm-up request runs first and is not counted).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from workflow_scripts.benchmark.metrics import acceptance, counter_delta, spec_decode_counters
from workflow_scripts.common.atomic import read_jsonl, write_json
from workflow_scripts.common.client import ChatClient
from workflow_scripts.common.config import typed
from workflow_scripts.common.server import ServerConfig, ServerSpec, VllmServer
from workflow_scripts.common.smk import stage

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BenchmarkConfig:
    """The `benchmark` config section."""

    num_speculative_tokens: int
    num_prompts: int
    max_tokens: int
    concurrency: int
    request_timeout_s: float


def main(smk) -> None:
    """The benchmark rule's job (rules/benchmark.smk)."""
    with stage(smk):
        server = ServerConfig.from_section(smk.params.server)
        run_benchmark(
            smk.input.prompts,
            smk.input.verifier,
            smk.input.draft,
            smk.output.report,
            str(Path(smk.log[0]).parent),
            server=ServerSpec.from_config(server, smk.input.verifier),
            cfg=typed(BenchmarkConfig, smk.params.benchmark, "benchmark"),
        )


def first_turn_messages(prompt: dict[str, Any]) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": prompt["system"]}] if prompt.get("system") else []
    return messages + [{"role": "user", "content": prompt["turns"][0]}]


async def run_workload(
    base_url: str, prompts: list[dict], cfg: BenchmarkConfig, model: str, label: str
) -> dict[str, Any]:
    sampling = {"max_tokens": cfg.max_tokens, "temperature": 0.0, "return_token_ids": True}
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
            return body["choices"][0].get("token_ids") or []

        started = time.perf_counter()
        outputs = await asyncio.gather(*(one(p) for p in prompts))
        wall = time.perf_counter() - started
        bar.close()
        after = spec_decode_counters(await client.get_text("/metrics"))
    tokens = sum(len(o) for o in outputs)
    return {
        "outputs": outputs,
        "wall_s": wall,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall,
        "counters": counter_delta(before, after),
    }


def identical_fraction(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of prompts whose greedy outputs are token-for-token equal. Pure."""
    return sum(x == y for x, y in zip(a, b, strict=True)) / max(1, len(a))


def run_benchmark(
    prompts_path: str,
    verifier_dir: str,
    draft_dir: str,
    out: str,
    log_dir: str,
    *,
    server: ServerSpec,
    cfg: BenchmarkConfig,
) -> None:
    prompts = read_jsonl(prompts_path)[: cfg.num_prompts]
    k = cfg.num_speculative_tokens
    speculative_spec = dataclasses.replace(
        server,
        speculative_config={"method": "eagle3", "model": str(Path(draft_dir).resolve()), "num_speculative_tokens": k},
    )
    results = {}
    for label, spec in (("baseline", server), ("speculative", speculative_spec)):
        with VllmServer(spec, Path(log_dir) / f"benchmark.vllm-{label}.log") as srv:
            results[label] = asyncio.run(run_workload(srv.base_url, prompts, cfg, spec.served_model_name, label))
        log.info("%s: %.1f output tok/s over %d prompts", label, results[label]["output_tokens_per_s"], len(prompts))
    acc = acceptance(results["speculative"]["counters"], k)
    base, spec = results["baseline"], results["speculative"]
    report = {
        "verifier": verifier_dir,
        "draft": draft_dir,
        "prompts": {"path": prompts_path, "count": len(prompts), "ids": [p["id"] for p in prompts]},
        "num_speculative_tokens": k,
        "sampling": {"temperature": 0.0, "max_tokens": cfg.max_tokens, "concurrency": cfg.concurrency},
        "server": {
            "dtype": server.dtype,
            "enforce_eager": server.enforce_eager,
            "tensor_parallel_size": server.tensor_parallel_size,
        },
        "baseline": {key: base[key] for key in ("output_tokens", "wall_s", "output_tokens_per_s")},
        "speculative": {**{key: spec[key] for key in ("output_tokens", "wall_s", "output_tokens_per_s")}, **acc},
        "speedup": spec["output_tokens_per_s"] / base["output_tokens_per_s"],
        "outputs_identical_fraction": identical_fraction(base["outputs"], spec["outputs"]),
    }
    write_json(out, report)
    log.info(
        "mean acceptance length %.3f, per position %s, speedup %.2fx, identical outputs %.0f%%",
        acc["mean_acceptance_length"],
        [round(x, 3) for x in acc["per_position_acceptance"]],
        report["speedup"],
        100 * report["outputs_identical_fraction"],
    )
