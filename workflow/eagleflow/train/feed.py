"""The served mode's feed: each sample's states requested ahead of the training step that needs
them, with the bytes in flight bounded (train/served.py says where the states come from).

The trainer hands the feed its schedules (`expect`: the eval split as one batch at setup, then
this rank's batches in step order from the resumed position on, so that no request is sent for
a batch already trained) and takes one batch at a time (`take`). A background thread runs an
event loop that walks the schedules and fetches each sample while the bytes of the states
requested and not yet taken stay within `max_bytes`; the batch the trainer takes next always
goes whole, so the peak is at most the bound plus one batch. `take` blocks until every sample
of its batch has arrived, and gives their bytes back to the budget.

What it measures (FeedStats): samples received and their rate, the seconds the trainer waited
on states (the server is the bottleneck), the seconds the feed held requests back because the
budget was full (the trainer is), and the peak bytes in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")  # what the schedule names (a token sample)
S = TypeVar("S")  # what a fetch returns (the sample with its states)


@dataclass
class FeedStats:
    """What the feed did; `summary` is the train log's and the stats row's view."""

    requested: int = 0  # samples whose states were asked for (retries not counted)
    received: int = 0
    received_bytes: int = 0
    trainer_wait_s: float = 0.0  # take() blocked: training waited on states
    server_wait_s: float = 0.0  # the budget was full: the feed held requests back
    peak_bytes_in_flight: int = 0
    first_request: float | None = None
    last_received: float | None = None
    counts: dict[str, int] = field(default_factory=dict)  # retries and refusals by kind

    def count(self, kind: str) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1

    def summary(self) -> dict[str, float | int]:
        span = (self.last_received or 0.0) - (self.first_request or 0.0)
        out = {k: v for k, v in asdict(self).items() if k not in ("first_request", "last_received", "counts")}
        out["samples_per_s"] = round(self.received / span, 3) if span > 0 else 0.0
        out["trainer_wait_s"] = round(self.trainer_wait_s, 3)
        out["server_wait_s"] = round(self.server_wait_s, 3)
        return out | {k: v for k, v in sorted(self.counts.items())}


class FeedError(RuntimeError):
    """A sample's states could not be had: the fetch's own error, raised where its batch is taken."""


class StatesFeed(Generic[T, S]):
    """Fetches the scheduled samples ahead of `take`, within `max_bytes` in flight and
    `concurrency` fetches at once. `fetch(item)` is a coroutine run on the feed's one event
    loop (a server's restart lock and the HTTP client live on it: one loop for the job);
    `nbytes(item)` is what its states will take, known before they are asked for. Schedules
    given by successive `expect` calls are walked in turn: the eval split's, then training's."""

    def __init__(
        self,
        fetch: Callable[[T], Awaitable[S]],
        nbytes: Callable[[T], int],
        max_bytes: int,
        concurrency: int,
        stats: FeedStats | None = None,
        session: Callable[[], contextlib.AbstractAsyncContextManager[None]] | None = None,
    ):
        self._fetch, self._nbytes = fetch, nbytes
        self.max_bytes, self.concurrency = max_bytes, concurrency
        self.stats = stats if stats is not None else FeedStats()
        self._session = session or contextlib.nullcontext
        self._done: dict[int, list[S | None]] = {}  # batch number -> its samples as they arrive
        self._missing: dict[int, int] = {}  # batch number -> samples not yet arrived
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._in_flight = 0
        self._next_take = 0
        self._loop = asyncio.new_event_loop()
        self._budget: asyncio.Condition | None = None
        self._schedules: asyncio.Queue[Iterator[list[T]]] | None = None
        self._task: asyncio.Task | None = None
        ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(ready,), name="states-feed", daemon=True)
        self._thread.start()
        ready.wait()

    def _serve(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._budget = asyncio.Condition()
        self._schedules = asyncio.Queue()
        self._task = self._loop.create_task(self._run())
        ready.set()
        try:
            self._loop.run_until_complete(self._task)
        except (asyncio.CancelledError, Exception):
            pass  # _run recorded its error for take(); a cancel is close()
        finally:
            self._loop.close()

    # --- the trainer's side ------------------------------------------------------------

    def expect(self, batches: Iterable[list[T]]) -> None:
        """Fetch `batches` (each a step's samples, in the order `take` will ask) after what was
        scheduled before."""
        schedule = iter(batches)
        self._loop.call_soon_threadsafe(lambda: self._schedules.put_nowait(schedule))

    def take(self, items: list[T]) -> list[S]:
        """The next scheduled batch's samples, which must be `items`; blocks until they are here."""
        started = time.monotonic()
        with self._cond:
            b = self._next_take
            while self._missing.get(b, 1) and self._error is None:
                self._cond.wait(timeout=1.0)
            if self._missing.get(b, 1):
                raise FeedError(f"batch {b} of the schedule: {self._error}") from self._error
            samples = self._done.pop(b)
            del self._missing[b]
            self._next_take += 1
        self.stats.trainer_wait_s += time.monotonic() - started
        if len(samples) != len(items):
            raise FeedError(f"batch {b}: the trainer asked for {len(items)} samples, the schedule had {len(samples)}")
        freed = sum(self._nbytes(item) for item in items)
        # A loop that has ended (the feed failed or was closed) has nothing left to admit.
        with contextlib.suppress(RuntimeError):
            asyncio.run_coroutine_threadsafe(self._release(freed), self._loop)
        return samples  # type: ignore[return-value]

    def close(self) -> None:
        """Stop fetching; what is in flight is dropped."""
        with contextlib.suppress(RuntimeError):  # the loop has ended already
            self._loop.call_soon_threadsafe(self._task.cancel)
        self._thread.join(timeout=30)

    # --- the loop's side ------------------------------------------------------------------

    async def _release(self, freed: int) -> None:
        assert self._budget is not None
        async with self._budget:
            self._in_flight -= freed
            self._budget.notify_all()

    def _fits(self, n: int, batch: int) -> bool:
        # The batch the trainer takes next always goes whole, or a batch larger than the
        # budget would wait for itself.
        return not self._in_flight or self._in_flight + n <= self.max_bytes or batch <= self._next_take

    async def _admit(self, n: int, batch: int) -> None:
        """Wait until `n` more bytes of `batch` fit the budget, then count them."""
        assert self._budget is not None
        async with self._budget:
            if not self._fits(n, batch):
                held = time.monotonic()
                await self._budget.wait_for(lambda: self._fits(n, batch))
                self.stats.server_wait_s += time.monotonic() - held
            self._in_flight += n
            self.stats.peak_bytes_in_flight = max(self.stats.peak_bytes_in_flight, self._in_flight)

    async def _run(self) -> None:
        try:
            async with self._session():
                await self._walk()
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError):
                self._fail(exc)
            raise

    async def _walk(self) -> None:
        slots = asyncio.Semaphore(self.concurrency)
        tasks: set[asyncio.Task] = set()
        b = 0  # batches are numbered across schedules, as take() counts them

        async def one(b: int, i: int, item: T, n: int) -> None:
            try:
                sample = await self._fetch(item)
            finally:
                slots.release()
            with self._cond:
                self._done[b][i] = sample
                self._missing[b] -= 1
                self.stats.received += 1
                self.stats.received_bytes += n
                self.stats.last_received = time.monotonic()
                self._cond.notify_all()

        try:
            while True:  # until close() cancels it
                for batch in await self._schedules.get():
                    with self._cond:
                        self._done[b] = [None] * len(batch)
                        self._missing[b] = len(batch)
                    for i, item in enumerate(batch):
                        n = self._nbytes(item)
                        await self._admit(n, b)
                        await slots.acquire()
                        if self.stats.first_request is None:
                            self.stats.first_request = time.monotonic()
                        self.stats.requested += 1
                        task = asyncio.create_task(one(b, i, item, n))
                        tasks.add(task)
                        task.add_done_callback(self._failed_or_done(tasks))
                    b += 1
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _failed_or_done(self, tasks: set[asyncio.Task]) -> Callable[[asyncio.Task], None]:
        def done(task: asyncio.Task) -> None:
            tasks.discard(task)
            if not task.cancelled() and task.exception() is not None:
                self._fail(task.exception())
                if self._task is not None:
                    self._task.cancel()

        return done

    def _fail(self, exc: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = exc
            self._cond.notify_all()
