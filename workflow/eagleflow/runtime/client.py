"""The async OpenAI-compatible chat client of every stage that talks to a server: generate,
write_prompts, benchmark, and the vllm backend of hidden_states.

httpx2 (the client stack `openai` itself ships; httpx 0.28's connection pool spends CPU
quadratic in the pool size per request, see BENCHMARKS.md) with explicit timeouts and a
connection pool sized to the concurrency limit;
retries with exponential backoff and jitter on connection errors, timeouts, 429 and 5xx.
With a `Concurrency` (runtime.concurrency) each attempt holds one of its slots and reports
how it went, and while the client is open the limit watches the server's /metrics; with a
`Recovery` (runtime.recovery) a dropped connection first asks whether the
server died, and a request that waited for its restart does not spend an attempt.
The API key comes from an environment variable named in config and is never logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx2 as httpx

from eagleflow.runtime.concurrency import DISCONNECT, FAILED, OK, OVERLOAD, TIMEOUT, Concurrency

if TYPE_CHECKING:
    from eagleflow.runtime.recovery import Recovery

log = logging.getLogger(__name__)

RETRYABLE_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})
OVERLOAD_STATUS = frozenset({429, 502, 503, 504})  # the server (or a proxy before it) is over capacity


class RequestFailed(RuntimeError):
    """A request failed for good: not retryable, or out of attempts. `reason` is one line."""

    def __init__(self, reason: str, attempts: int):
        super().__init__(f"{reason} (after {attempts} attempt{'s' if attempts != 1 else ''})")
        self.reason = reason
        self.attempts = attempts


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 4
    backoff_base_s: float = 0.5
    backoff_max_s: float = 30.0

    def delay(self, attempt: int) -> float:
        """Full-jitter exponential backoff: uniform in [0, min(max, base * 2**attempt)]."""
        return random.uniform(0.0, min(self.backoff_max_s, self.backoff_base_s * 2**attempt))


class ChatClient:
    """OpenAI-compatible completions (chat and plain) against one server or several
    data-parallel replicas, with retries.

    With several endpoints each request goes to the one with the fewest requests in flight,
    and a retry prefers another endpoint than the one that just failed.
    """

    def __init__(
        self,
        base_url: str | Sequence[str],
        *,
        concurrency: int,
        request_timeout_s: float,
        retry: RetryPolicy = RetryPolicy(),
        api_key_env: str | None = None,
        limit: Concurrency | None = None,
        recovery: Recovery | None = None,
    ):
        headers = {"Content-Type": "application/json"}
        if api_key_env:
            key = os.environ.get(api_key_env)
            if not key:
                raise ValueError(f"server.api_key_env names {api_key_env}, but that variable is not set")
            headers["Authorization"] = f"Bearer {key}"
        urls = [base_url] if isinstance(base_url, str) else list(base_url)
        if not urls:
            raise ValueError("ChatClient needs at least one endpoint")
        self.base_urls = [u.rstrip("/") for u in urls]
        self.retry = retry
        self.limit = limit
        self.recovery = recovery
        self._in_flight = [0] * len(self.base_urls)
        self._turn = 0  # ties between equally busy replicas go round
        self._watch: asyncio.Task | None = None
        self._clients = [
            httpx.AsyncClient(
                base_url=url,
                headers=headers,
                timeout=httpx.Timeout(request_timeout_s, connect=10.0),
                limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency),
            )
            for url in self.base_urls
        ]

    @property
    def base_url(self) -> str:
        return self.base_urls[0]

    async def __aenter__(self) -> ChatClient:
        if self.limit is not None:
            self._watch = asyncio.create_task(self.limit.watch(lambda: self.get_text("/metrics")))
        return self

    async def __aexit__(self, *exc) -> None:
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
        for client in self._clients:
            await client.aclose()

    def _pick(self, avoid: int | None) -> int:
        """The least busy replica (not `avoid`, the one a retry saw fail); among equally busy
        ones, each in turn (one request at a time would otherwise always go to the first)."""
        candidates = [i for i in range(len(self._clients)) if i != avoid] or [avoid]
        least = min(self._in_flight[i] for i in candidates)
        tied = [i for i in candidates if self._in_flight[i] == least]
        self._turn += 1
        return tied[self._turn % len(tied)]

    async def chat(self, payload: dict[str, Any]) -> dict[str, Any]:
        """POST /v1/chat/completions with retries; return the decoded JSON body."""
        return await self._post("/v1/chat/completions", payload)

    async def completion(self, payload: dict[str, Any]) -> dict[str, Any]:
        """POST /v1/completions (a prompt of text or token ids) with retries; return the body."""
        return await self._post("/v1/completions", payload)

    async def _post(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        last, failed, attempt = "no attempt made", None, 0
        while attempt < self.retry.max_attempts:
            if attempt:
                await asyncio.sleep(self.retry.delay(attempt))
            attempt += 1
            i, body, error, server_trouble = await self._attempt(failed, path, payload, attempt)
            if body is not None:
                return body
            last, failed = error, i
            # Outside the slot: a restart can take minutes.
            if server_trouble and self.recovery is not None and await self.recovery.recover(self.base_urls[i], error):
                attempt -= 1  # the server was down and is back: this try does not count
        raise RequestFailed(last, self.retry.max_attempts)

    async def _attempt(
        self, avoid: int | None, path: str, payload: dict[str, Any], attempt: int
    ) -> tuple[int, dict[str, Any] | None, str, bool]:
        """One try, holding a concurrency slot, at the endpoint with the fewest requests in
        flight once the slot is granted (preferably not `avoid`): (endpoint, body, "", False)
        on success, else (endpoint, None, why, whether the server itself may be down: a failed
        connection or an HTTP 500, which vLLM answers once its engine died). Raises
        RequestFailed when not retryable."""
        async with self._slot() as report:
            i = self._pick(avoid)
            url = self.base_urls[i]
            self._in_flight[i] += 1
            started = time.monotonic()
            try:
                resp = await self._clients[i].post(path, json=payload)
            except httpx.TimeoutException as exc:
                report(TIMEOUT)
                return i, None, f"{type(exc).__name__}: {exc or 'no detail'} ({url})", False
            except httpx.TransportError as exc:
                report(DISCONNECT)
                return i, None, f"{type(exc).__name__}: {exc or 'no detail'} ({url})", True
            finally:
                self._in_flight[i] -= 1
            if resp.status_code in RETRYABLE_STATUS:
                report(OVERLOAD if resp.status_code in OVERLOAD_STATUS else FAILED)
                return i, None, f"HTTP {resp.status_code} from {url}: {resp.text[:200]}", resp.status_code == 500
            if resp.status_code != 200:
                raise RequestFailed(f"HTTP {resp.status_code} from {url}: {resp.text[:300]}", attempt)
            try:
                body = resp.json()
            except json.JSONDecodeError:
                return i, None, f"malformed JSON from {url}: {resp.text[:200]!r}", False
            if not isinstance(body, dict) or not body.get("choices"):
                return i, None, f"reply without choices from {url}: {str(body)[:200]}", False
            tokens = (body.get("usage") or {}).get("completion_tokens")
            report(OK, time.monotonic() - started, tokens if isinstance(tokens, int) else None)
            return i, body, "", False

    def _slot(self):
        """A slot of the concurrency limit for one attempt (none without a limit)."""
        if self.limit is not None:
            return self.limit.slot()
        return _no_limit()

    async def get_text(self, path: str) -> str:
        """GET `path` from the first endpoint (e.g. /metrics of the one server a benchmark runs)."""
        resp = await self._clients[0].get(path)
        resp.raise_for_status()
        return resp.text


@contextlib.asynccontextmanager
async def _no_limit():
    yield lambda *args, **kwargs: None
