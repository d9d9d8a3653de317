"""How a benchmark set is measured against one server: the workload (the `benchmark`
section: tokens, concurrency, temperatures, seed), the requests of each conversation turn,
and one cell (a set at a temperature) as vLLM's acceptance counters and the streams see it.
Used by both the baseline and the benchmark rule (benchmark.run)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from eagleflow.benchmark.cells import cell_key
from eagleflow.benchmark.metrics import counter_delta, spec_decode_counters
from eagleflow.runtime.client import ChatClient

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

    def measured(self) -> dict[str, Any]:
        """What shapes the measurement, as the baseline rule's param: every field but
        request_timeout_s (operational: changing it reruns nothing). Pure."""
        return {
            "max_tokens": self.max_tokens,
            "concurrency": self.concurrency,
            "temperatures": list(self.temperatures),
            "seed": self.seed,
            "chat_template_kwargs": self.chat_template_kwargs,
        }

    @classmethod
    def from_measured(cls, measured: dict[str, Any], request_timeout_s: float) -> Workload:
        """The workload `measured()` returned, with the timeout of this run's config."""
        return cls(
            **{**measured, "temperatures": tuple(float(t) for t in measured["temperatures"])},
            request_timeout_s=request_timeout_s,
        )


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
