"""The async OpenAI-compatible chat client that synth and benchmark share.

httpx2 (the client stack `openai` itself ships; httpx 0.28's connection pool spends CPU
quadratic in the pool size per request, see BENCHMARKS.md) with explicit timeouts and a
connection pool sized to the concurrency limit;
retries with exponential backoff and jitter on connection errors, timeouts, 429 and 5xx.
The API key comes from an environment variable named in config and is never logged.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx2 as httpx

log = logging.getLogger(__name__)

RETRYABLE_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})


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
        self._in_flight = [0] * len(self.base_urls)
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
        return self

    async def __aexit__(self, *exc) -> None:
        for client in self._clients:
            await client.aclose()

    def _pick(self, avoid: int | None) -> int:
        candidates = [i for i in range(len(self._clients)) if i != avoid] or [avoid]
        return min(candidates, key=lambda i: self._in_flight[i])

    async def chat(self, payload: dict[str, Any]) -> dict[str, Any]:
        """POST /v1/chat/completions with retries; return the decoded JSON body."""
        return await self._post("/v1/chat/completions", payload)

    async def completion(self, payload: dict[str, Any]) -> dict[str, Any]:
        """POST /v1/completions (a prompt of text or token ids) with retries; return the body."""
        return await self._post("/v1/completions", payload)

    async def _post(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        last, failed = "no attempt made", None
        for attempt in range(self.retry.max_attempts):
            if attempt:
                await asyncio.sleep(self.retry.delay(attempt))
            i = self._pick(failed)
            url = self.base_urls[i]
            self._in_flight[i] += 1
            try:
                resp = await self._clients[i].post(path, json=payload)
            except (httpx.TimeoutException, httpx.TransportError) as exc:
                last, failed = f"{type(exc).__name__}: {exc or 'no detail'} ({url})", i
                continue
            finally:
                self._in_flight[i] -= 1
            if resp.status_code in RETRYABLE_STATUS:
                last, failed = f"HTTP {resp.status_code} from {url}: {resp.text[:200]}", i
                continue
            if resp.status_code != 200:
                raise RequestFailed(f"HTTP {resp.status_code} from {url}: {resp.text[:300]}", attempt + 1)
            try:
                body = resp.json()
            except json.JSONDecodeError:
                last, failed = f"malformed JSON from {url}: {resp.text[:200]!r}", i
                continue
            if not isinstance(body, dict) or not body.get("choices"):
                last, failed = f"reply without choices from {url}: {str(body)[:200]}", i
                continue
            return body
        raise RequestFailed(last, self.retry.max_attempts)

    async def get_text(self, path: str) -> str:
        """GET `path` from the first endpoint (e.g. /metrics of the one server a benchmark runs)."""
        resp = await self._clients[0].get(path)
        resp.raise_for_status()
        return resp.text
