"""How many requests a stage keeps in flight: a limit that follows the server's pressure.

Every stage that sends requests in bulk (generate, the vLLM hidden-state backend) takes a
slot per request from one `Concurrency`. Fixed, it is a semaphore of the configured size.
Adaptive (the default), the limit moves between 1 and the configured ceiling by AIMD:

- **increase**: +1 per window of successful replies (limit += 1/limit per reply), only while
  every slot is in use (a limit the stage does not reach says nothing) and the server shows
  no pressure. Until the first congestion the limit doubles per window instead (slow start),
  from `INITIAL`.
- **decrease**: the part of the limit above the floor (below) ×0.5 on congestion (the whole
  limit, without a floor): vLLM's preemption counter moved, or a request sent under
  the current limit met a 429/503 or a timeout (not a dropped connection: a dead server is
  restarted or waited for, not a reason to send less). At most once per
  window: signals from requests sent before the last decrease are ignored (they were sent
  under the old limit, as TCP ignores losses of packets sent before its last cut).
- **hold**: neither, while more requests wait in vLLM's queue than a small margin
  (`QUEUE_MARGIN` of those running, at least `MIN_QUEUE`), or, from a server without vLLM's
  metrics, a reply's time per output token is far above the best seen (`LATENCY_HOLD`).
- **floor**: a stage that knows how many tokens a request holds at its longest
  (`request_tokens`: prompt and max_tokens) and a vLLM that says how large its KV cache is
  (`vllm:cache_config_info`) give the number of requests that fit the cache at once even at
  their longest: they cannot preempt each other, so the limit starts there (not at
  `INITIAL`), never drops below it, and a preemption says only that the probe above it was
  too large.

Why AIMD, and these signals. A batched LLM server's throughput grows with the sequences it
runs until the KV cache is full; past that, more requests only wait or preempt running ones
(vLLM drops their KV cache and recomputes it later: work thrown away, the more the longer
their context, and on a host with little memory headroom a step towards running out). The
capacity moves during a run, since the KV cache a request holds grows with its output (a
burst of long reasoning traces fills it minutes after they were admitted), so no fixed
concurrency is right for a whole run. AIMD converges below a moving capacity and recovers
from overshoot within a few windows (Chiu and Jain 1989; TCP): vLLM's preemption counter
plays the part of packet loss, and the queue length the part of an early congestion mark.
A short queue is wanted, since it keeps the batch full while replies end and new requests
travel. The KV-cache usage is logged but does not hold the limit: vLLM fills its cache by
design, and holding at 90% usage kept the limit at half of what the server could run
(BENCHMARKS.md). Latency-gradient controllers (TCP Vegas, Netflix's concurrency-limits) read
a request's latency as queueing delay, but an LLM request's latency is mostly its output
length, and its time per output token grows with the batch (a batched server shares each
step between the sequences it runs): holding at 3x the best time per token kept the demo's
generation at 42-54 of its 64 with nothing waiting in vLLM. So latency per output token holds
the limit only for servers without vLLM's `/metrics` (another OpenAI-compatible server),
which leave errors, timeouts and latency.

The limit over time is logged and kept (`trace`) for the report's plot.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from eagleflow.common.prometheus import parse_prometheus

log = logging.getLogger(__name__)

AUTO_CEILING = 256  # `concurrency: auto`: vLLM's default max_num_seqs on GPUs
INITIAL = 4  # slow start's first limit (or the ceiling, when lower)
DECREASE = 0.5  # multiplicative decrease factor
QUEUE_MARGIN = 0.25  # hold while more than this share of the running requests wait ...
MIN_QUEUE = 2  # ... and at least this many
LATENCY_HOLD = 3.0  # hold while time per output token is this many times its best
POLL_S = 1.0  # /metrics poll period
LOG_EVERY_S = 30.0  # a status line at most this often (and at every decrease)
MAX_TRACE = 4000  # trace points kept (older ones are thinned, every other one dropped)

# Outcomes a request reports when it gives its slot back.
OK, OVERLOAD, TIMEOUT, DISCONNECT, FAILED = "ok", "overload", "timeout", "disconnect", "failed"
# A dropped or refused connection is not counted: a server that died is the Recovery's business
# (runtime.vllm_server), and every instant retry against it would otherwise cut the limit again.
CONGESTION = frozenset({OVERLOAD, TIMEOUT})


def parse_ceiling(value: int | str) -> int:
    """`concurrency` as configured: a positive integer, or "auto"."""
    if value == "auto":
        return AUTO_CEILING
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    raise ValueError(f"concurrency must be a positive integer or 'auto', got {value!r}")


@dataclass
class ServerSignals:
    """What vLLM's /metrics says (summed over engines), or None where it says nothing."""

    kv_usage: float | None = None
    running: float | None = None
    waiting: float | None = None
    preemptions: float | None = None
    kv_blocks: float | None = None  # KV-cache blocks (vllm:cache_config_info), summed over engines
    block_size: int | None = None  # tokens per block


METRICS = {
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:gpu_cache_usage_perc": "kv_usage",  # vLLM before 0.10
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_preemptions_total": "preemptions",
}


CACHE_INFO = "vllm:cache_config_info"  # an info gauge: the cache's settings are its labels


def parse_metrics(text: str) -> ServerSignals:
    """The signals in a Prometheus text exposition (common.prometheus reads it). Gauges and
    counters of several engines (label sets) are summed; the KV-cache usage is their maximum
    (one full engine preempts)."""
    found: dict[str, list[float]] = {}
    for (name, labels), value in parse_prometheus(text).items():
        if name == CACHE_INFO:
            info = dict(labels)
            with contextlib.suppress(KeyError, ValueError):
                blocks, size = float(info["num_gpu_blocks"]), int(info["block_size"])
                found.setdefault("kv_blocks", []).append(blocks)
                found["block_size"] = [size]
        elif name in METRICS:
            found.setdefault(METRICS[name], []).append(value)
    signals = ServerSignals()
    for attr, values in found.items():
        setattr(signals, attr, max(values) if attr in ("kv_usage", "block_size") else sum(values))
    return signals


@dataclass
class Concurrency:
    """A limit on requests in flight. `slot()` for each request; `watch()` beside them."""

    ceiling: int
    adaptive: bool = True
    name: str = "requests"
    request_tokens: int | None = None  # tokens a request holds at its longest (prompt + max_tokens), if known
    limit: float = field(init=False)
    floor: int = field(default=1, init=False)  # requests the server's KV cache holds at their longest
    in_flight: int = field(default=0, init=False)
    decreases: int = field(default=0, init=False)
    preemptions_seen: float = field(default=0.0, init=False)
    trace: list[tuple[float, int, int]] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        if self.ceiling < 1:
            raise ValueError(f"concurrency ceiling must be at least 1, got {self.ceiling}")
        self.limit = float(min(self.ceiling, INITIAL) if self.adaptive else self.ceiling)
        self._started = time.monotonic()
        self._started_at = time.time()
        self._waiters: collections.deque[asyncio.Future] = collections.deque()
        self._tickets = 0  # requests admitted so far
        self._window_start = 0  # first ticket sent under the current limit
        self._slow_start = True
        self._signals = ServerSignals()
        self._preemptions: float | None = None
        self._best_token_s: float | None = None
        self._token_s_ewma: float | None = None
        self._logged = 0.0
        self._metrics_seen = False
        self._record()

    @property
    def current(self) -> int:
        return max(1, math.floor(self.limit))

    # ---- admission -------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[Callable[..., None]]:
        """Hold one slot for a request; the body calls the yielded `report(outcome, ...)`
        once it knows how the request went (no report: the slot returns as `FAILED`)."""
        await self._acquire()
        ticket = self._tickets
        self._tickets += 1
        reported = False

        def report(outcome: str, latency_s: float | None = None, tokens: int | None = None) -> None:
            nonlocal reported
            if not reported:
                reported = True
                self._outcome(outcome, ticket, latency_s, tokens)

        try:
            yield report
        finally:
            report(FAILED)
            self.in_flight -= 1
            self._wake()

    async def _acquire(self) -> None:
        # First come, first served: a waiter is granted its slot (counted in flight) by _wake.
        if self.in_flight < self.current and not self._waiters:
            self.in_flight += 1
            return
        granted = asyncio.get_running_loop().create_future()
        self._waiters.append(granted)
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():
                self.in_flight -= 1  # granted just before the cancel: give it back
                self._wake()
            else:
                self._waiters.remove(granted)
            raise

    def _wake(self) -> None:
        while self._waiters and self.in_flight < self.current:
            granted = self._waiters.popleft()
            if not granted.done():
                self.in_flight += 1
                granted.set_result(None)

    # ---- the controller ----------------------------------------------------------------

    def _outcome(self, outcome: str, ticket: int, latency_s: float | None, tokens: int | None) -> None:
        if not self.adaptive:
            return
        if outcome in CONGESTION:
            if ticket >= self._window_start:
                self._decrease(outcome)
            return
        if outcome != OK:
            return
        if latency_s is not None and tokens:
            per_token = latency_s / tokens
            self._token_s_ewma = per_token if self._token_s_ewma is None else 0.8 * self._token_s_ewma + 0.2 * per_token
            self._best_token_s = min(self._best_token_s or self._token_s_ewma, self._token_s_ewma)
        # The limit grows only while it is what holds requests back: every slot was in use.
        if self.in_flight < self.current or self._hold_reason():
            return
        step = 1.0 if self._slow_start else 1.0 / self.limit
        self._set(min(float(self.ceiling), self.limit + step), None)

    def _hold_reason(self) -> str | None:
        s = self._signals
        if s.waiting is not None and s.waiting >= max(MIN_QUEUE, QUEUE_MARGIN * (s.running or 0)):
            return f"{s.waiting:.0f} requests waiting in the server"
        if self._metrics_seen:
            return None  # the queue and the preemptions speak; latency per token grows with the batch
        if self._best_token_s and self._token_s_ewma and self._token_s_ewma > LATENCY_HOLD * self._best_token_s:
            return f"{self._token_s_ewma * 1e3:.0f} ms per output token, best {self._best_token_s * 1e3:.0f} ms"
        return None

    def _decrease(self, why: str) -> None:
        if self.current <= self.floor:
            return  # at the floor: nothing to take away, nothing to log
        self._slow_start = False
        self.decreases += 1
        self._window_start = self._tickets  # signals of requests already sent are of the old limit
        # The floor's requests cannot preempt one another: the cut is of the probe above it.
        self._set(self.floor + (self.limit - self.floor) * DECREASE, why)

    def _set(self, limit: float, why: str | None) -> None:
        before = self.current
        self.limit = limit
        if self.current != before:
            self._record()
            self._wake()
        if why is not None:
            log.info(
                "%s: concurrency %d -> %d (%s; %d in flight, ceiling %d)",
                self.name,
                before,
                self.current,
                why,
                self.in_flight,
                self.ceiling,
            )
        elif time.monotonic() - self._logged >= LOG_EVERY_S:
            self._logged = time.monotonic()
            log.info(
                "%s: concurrency %d (%d in flight, ceiling %d)", self.name, self.current, self.in_flight, self.ceiling
            )

    def _record(self) -> None:
        self.trace.append((round(time.monotonic() - self._started, 3), self.current, self.in_flight))
        if len(self.trace) > MAX_TRACE:
            self.trace = self.trace[::2]

    def observe(self, signals: ServerSignals) -> None:
        """A /metrics reading: the KV cache's size sets the floor; a moved preemption counter
        is congestion, once per window."""
        self._signals = signals
        self._metrics_seen = True
        self._raise_floor(signals)
        if signals.preemptions is None:
            return
        if self._preemptions is not None and signals.preemptions > self._preemptions:
            self.preemptions_seen += signals.preemptions - self._preemptions
            # Once per window: a request sent since the last decrease has to have finished.
            if self.adaptive and self._completed_in_window():
                self._decrease(f"{signals.preemptions - self._preemptions:.0f} preemptions in the server")
        self._preemptions = signals.preemptions

    def _raise_floor(self, signals: ServerSignals) -> None:
        if not (self.adaptive and self.request_tokens and signals.kv_blocks and signals.block_size):
            return
        blocks_each = math.ceil(self.request_tokens / signals.block_size)
        floor = max(1, min(self.ceiling, int(signals.kv_blocks // blocks_each)))
        if floor <= self.floor:
            return
        self.floor = floor
        if self.limit < floor:
            why = f"the KV cache holds {floor} requests of up to {self.request_tokens} tokens"
            self._set(float(floor), why)

    def _completed_in_window(self) -> bool:
        # Tickets from _window_start on were sent under the current limit; the oldest of them
        # has finished once fewer than (tickets issued since) are still in flight.
        return self._tickets - self._window_start > self.in_flight

    async def watch(self, get_metrics: Callable[[], Awaitable[str]]) -> None:
        """Poll the server's /metrics until cancelled. A server that never gives vLLM's
        metrics (an error, or no vllm: lines) leaves the error and latency signals; one that
        gave them and stops answering (restarting) is polled on."""
        seen = False
        while True:
            try:
                signals = parse_metrics(await get_metrics())
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # any failure: no metrics from this server (now)
                signals, error = None, exc
            if signals is not None and signals != ServerSignals():
                seen = True
                self.observe(signals)
            elif not seen:
                why = f"no /metrics ({error})" if signals is None else "no vLLM metrics in /metrics"
                log.info("%s: %s: adapting to errors and latency only", self.name, why)
                return
            await asyncio.sleep(POLL_S)

    def summary(self) -> dict[str, Any]:
        """What stats.json keeps: the settings, the outcome and the limit over time."""
        self._record()
        return {
            "adaptive": self.adaptive,
            "ceiling": self.ceiling,
            "final": self.current,
            "floor": self.floor,
            "request_tokens": self.request_tokens,
            "decreases": self.decreases,
            "server_preemptions": round(self.preemptions_seen),
            "started_at": self._started_at,  # Unix time of the trace's 0 s
            "trace": [list(point) for point in self.trace],  # [seconds, limit, requests in flight]
        }
