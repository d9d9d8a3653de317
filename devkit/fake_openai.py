"""A local OpenAI-compatible chat server for what vLLM cannot be made to do: injected
faults, exact latencies, malformed replies.

    python -m devkit.fake_openai --latency 0.05 --fault-rate 0.3 --lifetime 120

Binds 127.0.0.1 on a free port (or --port), prints `READY <port>` and serves until
--lifetime seconds or --max-requests requests have passed, then exits by itself. Replies are
a pure function of the request messages, so an interrupted run and an uninterrupted one must
produce identical samples. Faults are drawn per request from a seeded generator:
500/503, 429, connection reset, a hang past the client's timeout, and malformed JSON. A
conversation whose last user message contains POISON always gets HTTP 500.

`--capacity 8@0,2@4` makes a server of changing capacity: 8 requests at once from its start,
2 from 4 s on; a request above the capacity gets 503 at once. GET /stats says, per phase,
how many requests it accepted, the most it held at once and how many it refused.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import random
import subprocess
import sys
import time
from pathlib import Path

from aiohttp import web

FAULTS = ("http500", "http503", "http429", "reset", "hang", "malformed")


def reply_for(messages: list[dict], max_tokens: int) -> dict:
    """A deterministic completion: token ids and text derived from a hash of the messages."""
    digest = hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).digest()
    n = 4 + digest[0] % 12
    n_out = min(n, max_tokens)
    completion_ids = [100 + b for b in digest[1 : 1 + n_out]]
    prompt_ids = [1] + [10 + (len(m["content"]) % 50) for m in messages] + [2]
    finish = "length" if n_out < n else "stop"
    if finish == "stop":
        completion_ids = completion_ids + [2]
    return {
        "id": "chatcmpl-" + digest.hex()[:16],
        "object": "chat.completion",
        "model": "verifier",
        "system_fingerprint": "fake-openai",
        "prompt_token_ids": prompt_ids,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "reply " + digest.hex()[: n_out * 2], "reasoning": None},
                "finish_reason": finish,
                "token_ids": completion_ids,
            }
        ],
        "usage": {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(completion_ids),
            "total_tokens": len(prompt_ids) + len(completion_ids),
        },
    }


def parse_capacity(spec: str | None) -> list[tuple[float, int]]:
    """ "8@0,2@4" -> [(0.0, 8), (4.0, 2)]: (from second, capacity), in time order."""
    if not spec:
        return []
    phases = sorted((float(at), int(cap)) for cap, at in (part.split("@") for part in spec.split(",")))
    assert phases[0][0] == 0, "the first capacity phase must start at 0"
    return phases


class FakeServer:
    def __init__(self, latency_s: float, fault_rate: float, seed: int, hang_s: float, capacity: str | None = None):
        self.latency_s = latency_s
        self.fault_rate = fault_rate
        self.rng = random.Random(seed)
        self.hang_s = hang_s
        self.requests = 0
        self.capacity = parse_capacity(capacity)
        self.started = time.monotonic()
        self.in_flight = 0
        self.phases = [
            {"from_s": at, "capacity": cap, "accepted": 0, "max_in_flight": 0, "refused": 0}
            for at, cap in self.capacity
        ]

    def _phase(self) -> dict | None:
        elapsed = time.monotonic() - self.started
        current = None
        for phase in self.phases:
            if phase["from_s"] <= elapsed:
                current = phase
        return current

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        phase = self._phase()
        if phase is not None and self.in_flight >= phase["capacity"]:
            phase["refused"] += 1
            return web.json_response({"error": "over capacity"}, status=503)
        self.in_flight += 1
        try:
            if phase is not None:
                phase["accepted"] += 1
                phase["max_in_flight"] = max(phase["max_in_flight"], self.in_flight)
            return await self._reply(request)
        finally:
            self.in_flight -= 1

    async def _reply(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        messages = body["messages"]
        if "POISON" in messages[-1]["content"]:
            return web.json_response({"error": "poisoned prompt"}, status=500)
        if self.rng.random() < self.fault_rate:
            fault = self.rng.choice(FAULTS)
            if fault == "http500":
                return web.json_response({"error": "internal"}, status=500)
            if fault == "http503":
                return web.json_response({"error": "unavailable"}, status=503)
            if fault == "http429":
                return web.json_response({"error": "slow down"}, status=429, headers={"Retry-After": "0"})
            if fault == "reset":
                request.transport.close()
                return web.Response(status=500)
            if fault == "hang":
                await asyncio.sleep(self.hang_s)
            if fault == "malformed":
                return web.Response(status=200, text='{"choices": [{"message": ', content_type="application/json")
        return web.json_response(reply_for(messages, body.get("max_tokens", 16)))

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=f"fake_requests_total {self.requests}\n")

    async def stats(self, request: web.Request) -> web.Response:
        started_at = time.time() - (time.monotonic() - self.started)
        return web.json_response({"requests": self.requests, "started_at": started_at, "phases": self.phases})


async def serve(port: int, lifetime_s: float, max_requests: int | None, server: FakeServer) -> None:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", server.chat)
    app.router.add_get("/health", server.health)
    app.router.add_get("/metrics", server.metrics)
    app.router.add_get("/stats", server.stats)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port, backlog=1024)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]
    print(f"READY {bound}", flush=True)
    deadline = time.monotonic() + lifetime_s
    while time.monotonic() < deadline and (max_requests is None or server.requests < max_requests):
        await asyncio.sleep(0.2)
    await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--latency", type=float, default=0.0, help="seconds before every reply")
    p.add_argument("--fault-rate", type=float, default=0.0)
    p.add_argument("--hang", type=float, default=30.0, help="seconds a 'hang' fault stalls")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lifetime", type=float, default=300.0, help="exit after this many seconds")
    p.add_argument("--max-requests", type=int, default=None)
    p.add_argument("--capacity", default=None, help="CAP@SECONDS,...: requests held at once from then on")
    a = p.parse_args(argv)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(
        serve(a.port, a.lifetime, a.max_requests, FakeServer(a.latency, a.fault_rate, a.seed, a.hang, a.capacity))
    )
    sys.exit(0)


@contextlib.contextmanager
def fake_openai_server(*args: str):
    """Start this server in its own process; yield its base URL; stop it."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "devkit.fake_openai", *args],
        cwd=Path(__file__).resolve().parents[1],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("READY"), f"fake server did not start: {line!r}"
        yield f"http://127.0.0.1:{int(line.split()[1])}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


if __name__ == "__main__":
    main()
