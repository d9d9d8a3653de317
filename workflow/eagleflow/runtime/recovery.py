"""What a client does when its server stops answering: restart a server this job launched
(or the phase's shared one), or wait for an endpoint it did not start."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import httpx2 as httpx

from eagleflow.runtime.spec import ServerError
from eagleflow.runtime.vllm_server import describe_exit, tail

if TYPE_CHECKING:
    from eagleflow.runtime.shared_server import SharedServer
    from eagleflow.runtime.vllm_server import VllmServer

log = logging.getLogger(__name__)


async def _health(url: str) -> int | None:
    """The status of GET `url`/health, or None when nothing answers."""
    try:
        async with httpx.AsyncClient(timeout=5.0) as client:
            return (await client.get(f"{url.rstrip('/')}/health")).status_code
    except httpx.HTTPError:
        return None


async def answers(url: str) -> bool:
    """Whether anything listens at `url`: any HTTP reply to GET /health (an OpenAI-compatible
    server without that route answers 404) counts; a refused or dropped connection does not."""
    return await _health(url) is not None


async def healthy(url: str) -> bool:
    """Whether vLLM at `url` says it is healthy (its /health is 500 once its engine died)."""
    return await _health(url) == 200


class Recovery:
    """What a client does when its server stops answering: `recover` returns True when the
    server is back (the failed request is retried without spending an attempt), False when
    the server is fine (the failure was the request's own: the retry policy goes on), or
    raises ServerError when it gives up."""

    restarts = 0  # servers this job started again

    async def recover(self, url: str, cause: str) -> bool:
        raise NotImplementedError


class RestartServer(Recovery):
    """Start a server again when it died (or lives on without a healthy engine: /health is
    not 200), at most `max_restarts` times per job. The requests in flight are sent again;
    nothing stored is lost. Subclasses say how to tell (`_trouble`), how to restart
    (`_restart`) and how to give up (`_give_up`)."""

    def __init__(self, server, max_restarts: int):
        self.server = server
        self.max_restarts = max_restarts
        self._lock = asyncio.Lock()

    label = ""  # how the log names the server: "" or "the shared "

    async def recover(self, url: str, cause: str) -> bool:
        restarts = self.restarts
        async with self._lock:
            if self.restarts != restarts:
                return True  # restarted while this request waited for the lock
            trouble = await self._trouble(url)
            if trouble is None:
                return False
            what = f"{self.label}{self.server.spec.name} ({self.server.spec.model}) {trouble}"
            if self.restarts >= self.max_restarts:
                raise self._give_up(
                    f"{what}, after {self.restarts} restart(s) in this job (server.max_restarts: {self.max_restarts})"
                )
            self.restarts += 1
            log.warning(
                "%s (a request saw: %s). Restart %d of %d; last lines of %s:\n%s",
                what,
                cause,
                self.restarts,
                self.max_restarts,
                self.server.log_path,
                tail(self.server.log_path, 20),
            )
            await self._restart()
            return True

    async def _trouble(self, url: str) -> str | None:
        raise NotImplementedError

    async def _restart(self) -> None:
        raise NotImplementedError

    def _give_up(self, message: str) -> Exception:
        raise NotImplementedError


class RestartDeadServer(RestartServer):
    """RestartServer for a server this job launched."""

    server: VllmServer

    async def _restart(self) -> None:
        # Again on the same port, so clients keep their URL. The launch runs in this thread,
        # the event loop's, which lives as long as the job (see VllmServer.launch).
        await asyncio.to_thread(self.server.stop)
        self.server.launch(kind="restart")
        await asyncio.to_thread(self.server.wait_healthy)

    def _give_up(self, message: str) -> Exception:
        return self.server._failure(message)

    async def _trouble(self, url: str) -> str | None:
        """None while /health answers 200; what is wrong once the server has exited, or has
        not answered 200 for the stop grace period and 10 s (a dropped connection can come a
        moment before the supervisor has stopped the group and exited)."""
        deadline = time.monotonic() + self.server.spec.stop_grace_s + 10
        while True:
            status = self.server.exit_status()
            if status is not None:
                return f"died while serving ({describe_exit(status)})"
            if await healthy(url):
                return None
            if time.monotonic() > deadline:
                return f"runs, but its /health has not answered 200 for {self.server.spec.stop_grace_s + 10:.0f} s"
            await asyncio.sleep(0.5)


class WaitForEndpoint(Recovery):
    """For a server this job did not start (`server.endpoint`): wait for it to answer again,
    at most `budget_s` in all for the job (server.endpoint_wait_s)."""

    def __init__(self, budget_s: float):
        self.budget_s = budget_s
        self.waited_s = 0.0
        self._lock = asyncio.Lock()

    async def recover(self, url: str, cause: str) -> bool:
        async with self._lock:
            if await answers(url):
                return False
            log.warning("the server at %s does not answer (%s): waiting for it (server.endpoint_wait_s)", url, cause)
            while self.waited_s < self.budget_s:
                started = time.monotonic()
                await asyncio.sleep(min(5.0, self.budget_s - self.waited_s))
                back = await answers(url)
                self.waited_s += time.monotonic() - started
                if back:
                    log.warning("the server at %s answers again; %.0f s of waiting spent", url, self.waited_s)
                    return True
            raise ServerError(
                f"the server at {url} has not answered for {self.waited_s:.0f} s in this job "
                f"(server.endpoint_wait_s: {self.budget_s:g}); last error: {cause}"
            )


class RestartSharedServer(RestartServer):
    """RestartServer for a shared server: whichever job sees it die first starts it again
    (under the shared lock); the others find the new one on the same port."""

    server: SharedServer
    label = "the shared "

    async def _restart(self) -> None:
        await asyncio.to_thread(self.server.restart, self._seen)

    def _give_up(self, message: str) -> Exception:
        return ServerError(f"{message}. Last lines of {self.server.log_path}:\n{tail(self.server.log_path)}")

    async def _trouble(self, url: str) -> str | None:
        self._seen = self.server.state["pgid"]  # the server this request saw: restart only it
        grace = self.server.spec.stop_grace_s + 10
        deadline = time.monotonic() + grace
        while True:
            if not self.server.alive():
                return f"died while serving ({self.server.describe_end()})"
            if await healthy(url):
                return None
            if time.monotonic() > deadline:
                return f"runs, but its /health has not answered 200 for {grace:.0f} s"
            await asyncio.sleep(0.5)


class ByUrl(Recovery):
    """Several servers behind one client (launched replicas): each URL's own recovery."""

    def __init__(self, by_url: dict[str, Recovery]):
        self.by_url = {url.rstrip("/"): recovery for url, recovery in by_url.items()}

    @property
    def restarts(self) -> int:  # type: ignore[override]
        return sum(r.restarts for r in self.by_url.values())

    async def recover(self, url: str, cause: str) -> bool:
        return await self.by_url[url.rstrip("/")].recover(url, cause)
