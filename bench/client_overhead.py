"""Throughput and client CPU of eagleflow's ChatClient against the `openai` package's AsyncOpenAI.

    .venv/bin/python bench/client_overhead.py [--quick] [--out bench_client.md]

Starts devkit/fake_openai.py in its own process, once replying instantly and once after 50 ms,
so `time.process_time()` of this process is the client's CPU alone. For each concurrency in
(1, 32, 128, 256) both clients send the same N requests, each call bounded by an
asyncio.Semaphore(concurrency). The clients alternate A B B A on halves of N within one row so
both see the same machine conditions. At 50 ms the ideal rate is concurrency / 0.05 req/s.

Prints a Markdown table (and writes it to --out): req/s, client CPU ms/req, their ratios, and
at 50 ms the % of the ideal rate; then a second table of core use: client CPU s / wall s per
client and the whole box's busy share (server, client and anything else, of all cores), which
says whether a row was limited by the client, by the server, or by neither.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from openai import AsyncOpenAI

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "workflow"))  # the eagleflow package, installed or not

from devkit.fake_openai import fake_openai_server as fake_openai  # noqa: E402
from eagleflow.runtime.client import ChatClient  # noqa: E402

CONCURRENCIES = (1, 32, 128, 256)
LATENCIES_S = (0.0, 0.05)
MODEL = "verifier"
MAX_TOKENS = 16
SERVER_LIFETIME_S = 900  # a backstop only: the context manager stops the server after its rows


def n_requests(latency_s: float, concurrency: int, quick: bool) -> int:
    """Enough requests that a row takes a few seconds per client on the 2-core box."""
    if latency_s == 0:
        return 200 if quick else 2000
    return max(40, 2 * concurrency) if quick else max(200, 20 * concurrency)


def payloads(n: int, offset: int) -> list[dict]:
    # One distinct user message per request, so the fake server hashes (and replies to) each anew.
    return [
        {
            "model": MODEL,
            "messages": [
                {"role": "user", "content": f"Request {offset + i}: write a haiku about speculative decoding."}
            ],
            "max_tokens": MAX_TOKENS,
            "return_token_ids": True,
        }
        for i in range(n)
    ]


def box_cpu_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies over all cores since boot, from /proc/stat; (0, 0) where there is none."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


@dataclass
class Sample:
    requests: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    box_busy: int = 0
    box_total: int = 0

    def add(self, requests: int, wall_s: float, cpu_s: float, box_busy: int, box_total: int) -> None:
        self.requests += requests
        self.wall_s += wall_s
        self.cpu_s += cpu_s
        self.box_busy += box_busy
        self.box_total += box_total

    @property
    def rate(self) -> float:
        return self.requests / self.wall_s

    @property
    def cpu_ms_per_request(self) -> float:
        return 1000 * self.cpu_s / self.requests

    @property
    def client_core_share(self) -> float:
        return self.cpu_s / self.wall_s

    @property
    def box_busy_share(self) -> float:
        return self.box_busy / self.box_total if self.box_total else float("nan")


Send = Callable[[dict], Awaitable[object]]


async def run_bounded(send: Send, batch: list[dict], concurrency: int) -> None:
    sem = asyncio.Semaphore(concurrency)

    async def one(payload: dict) -> None:
        async with sem:
            await send(payload)

    await asyncio.gather(*(one(p) for p in batch))


async def timed(send: Send, batch: list[dict], concurrency: int, into: Sample) -> None:
    busy0, total0 = box_cpu_jiffies()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    await run_bounded(send, batch, concurrency)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    busy1, total1 = box_cpu_jiffies()
    into.add(len(batch), wall, cpu, busy1 - busy0, total1 - total0)


async def measure_row(base_url: str, concurrency: int, n: int) -> tuple[Sample, Sample]:
    """Both clients on the same n payloads, A B B A on halves of n; returns (eagleflow, openai)."""
    eagleflow, oai = Sample(), Sample()
    warmup = payloads(max(2 * concurrency, 20), offset=10**6)
    first, second = payloads(n // 2, 0), payloads(n - n // 2, n // 2)
    async with ChatClient(base_url, concurrency=concurrency, request_timeout_s=60) as ef_client:
        oai_client = AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
        async with oai_client:

            async def send_oai(p: dict) -> object:
                return await oai_client.chat.completions.create(
                    model=p["model"],
                    messages=p["messages"],
                    max_tokens=p["max_tokens"],
                    extra_body={"return_token_ids": p["return_token_ids"]},
                )

            # Warm-up opens the connection pools and fills lazy imports and caches of both clients.
            await run_bounded(ef_client.chat, warmup, concurrency)
            await run_bounded(send_oai, warmup, concurrency)
            await timed(ef_client.chat, first, concurrency, eagleflow)
            await timed(send_oai, first, concurrency, oai)
            await timed(send_oai, second, concurrency, oai)
            await timed(ef_client.chat, second, concurrency, eagleflow)
    return eagleflow, oai


def pct_ideal(sample: Sample, latency_s: float, concurrency: int) -> str:
    if not latency_s:
        return "–"
    return f"{100 * sample.rate / (concurrency / latency_s):.1f}%"


def render(rows: list[tuple[float, int, int, Sample, Sample]]) -> str:
    lines = [
        "| latency | concurrency | N | eagleflow req/s | AsyncOpenAI req/s | ratio (ef/oai) "
        "| eagleflow CPU ms/req | openai CPU ms/req | CPU ratio (ef/oai) | eagleflow % ideal | openai % ideal |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for latency_s, c, n, ef, oai in rows:
        lines.append(
            f"| {latency_s * 1000:.0f} ms | {c} | {n} | {ef.rate:.0f} | {oai.rate:.0f} | {ef.rate / oai.rate:.2f} "
            f"| {ef.cpu_ms_per_request:.3f} | {oai.cpu_ms_per_request:.3f} "
            f"| {ef.cpu_ms_per_request / oai.cpu_ms_per_request:.2f} "
            f"| {pct_ideal(ef, latency_s, c)} | {pct_ideal(oai, latency_s, c)} |"
        )
    lines += [
        "",
        "Core use: client CPU s / wall s (1.00 = this single-threaded client kept one core busy); "
        f"box busy = all processes, share of {os.cpu_count()} cores.",
        "",
        "| latency | concurrency | eagleflow client core | openai client core | box busy (ef) | box busy (oai) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for latency_s, c, _, ef, oai in rows:
        lines.append(
            f"| {latency_s * 1000:.0f} ms | {c} | {ef.client_core_share:.2f} | {oai.client_core_share:.2f} "
            f"| {100 * ef.box_busy_share:.0f}% | {100 * oai.box_busy_share:.0f}% |"
        )
    return "\n".join(lines)


def header() -> str:
    # Both clients now run on httpx2 + httpcore2 (openai ships it); name the versions.
    versions = []
    for dist in ("httpx", "httpcore", "openai", "httpx2", "httpcore2"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions.append(f"{dist} {metadata.version(dist)}")
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"Python {platform.python_version()}, {', '.join(versions)}; {os.cpu_count()} cores, "
        f"load average at start {load}; {time.strftime('%Y-%m-%d %H:%M')}"
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="about a tenth of the requests: a smoke run, not a measurement")
    p.add_argument("--out", type=Path, default=None, help="also write the Markdown tables here")
    a = p.parse_args(argv)

    head = header()
    print(head, flush=True)
    rows = []
    for latency_s in LATENCIES_S:
        with fake_openai("--latency", str(latency_s), "--lifetime", str(SERVER_LIFETIME_S)) as base_url:
            for c in CONCURRENCIES:
                n = n_requests(latency_s, c, a.quick)
                ef, oai = asyncio.run(measure_row(base_url, c, n))
                rows.append((latency_s, c, n, ef, oai))
                print(
                    f"latency {latency_s * 1000:.0f} ms, concurrency {c}, N {n}: "
                    f"eagleflow {ef.rate:.0f} req/s {ef.cpu_ms_per_request:.3f} ms CPU/req; "
                    f"openai {oai.rate:.0f} req/s {oai.cpu_ms_per_request:.3f} ms CPU/req",
                    file=sys.stderr,
                    flush=True,
                )
    table = render(rows)
    print("\n" + table)
    if a.out:
        a.out.write_text(f"{head}\n\n{table}\n")


if __name__ == "__main__":
    main()
