"""The async OpenAI-compatible chat client that synth and benchmark share.

httpx with explicit timeouts and a connection pool sized to the concurrency limit;
retries with exponential backoff and jitter on connection errors, timeouts, 429 and 5xx.
The API key comes from an environment variable named in config and is never logged.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
from dataclasses import dataclass
from typing import Any

import httpx

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
    def __init__(
        self,
        base_url: str,
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
        self.base_url = base_url.rstrip("/")
        self.retry = retry
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(request_timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency),
        )

    async def __aenter__(self) -> ChatClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self._client.aclose()

    async def chat(self, payload: dict[str, Any]) -> dict[str, Any]:
        """POST /v1/chat/completions with retries; return the decoded JSON body."""
        last = "no attempt made"
        for attempt in range(self.retry.max_attempts):
            if attempt:
                await asyncio.sleep(self.retry.delay(attempt))
            try:
                resp = await self._client.post("/v1/chat/completions", json=payload)
            except (httpx.TimeoutException, httpx.TransportError) as exc:
                last = f"{type(exc).__name__}: {exc or 'no detail'} ({self.base_url})"
                continue
            if resp.status_code in RETRYABLE_STATUS:
                last = f"HTTP {resp.status_code} from {self.base_url}: {resp.text[:200]}"
                continue
            if resp.status_code != 200:
                raise RequestFailed(f"HTTP {resp.status_code} from {self.base_url}: {resp.text[:300]}", attempt + 1)
            try:
                body = resp.json()
            except json.JSONDecodeError:
                last = f"malformed JSON from {self.base_url}: {resp.text[:200]!r}"
                continue
            if not isinstance(body, dict) or not body.get("choices"):
                last = f"reply without choices from {self.base_url}: {str(body)[:200]}"
                continue
            return body
        raise RequestFailed(last, self.retry.max_attempts)

    async def get_text(self, path: str) -> str:
        resp = await self._client.get(path)
        resp.raise_for_status()
        return resp.text
