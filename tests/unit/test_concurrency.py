"""The concurrency limit (runtime.concurrency): fixed and adaptive admission, AIMD against a
simulated server of known capacity, vLLM's /metrics signals, and once-per-window decreases."""

import asyncio
import random

import pytest

from eagleflow.runtime.concurrency import (
    AUTO_CEILING,
    DISCONNECT,
    INITIAL,
    OK,
    OVERLOAD,
    Concurrency,
    ServerSignals,
    parse_ceiling,
    parse_metrics,
)

# What vLLM 0.32's /metrics holds, trimmed: two engines (data parallel), HELP/TYPE lines.
VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="verifier"} 5.0
vllm:num_requests_running{engine="1",model_name="verifier"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="verifier"} 2.0
vllm:num_requests_waiting{engine="1",model_name="verifier"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="verifier"} 0.42
vllm:kv_cache_usage_perc{engine="1",model_name="verifier"} 0.93
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="verifier"} 4.0
vllm:num_preemptions_total{engine="1",model_name="verifier"} 1.0
vllm:num_preemptions_created{engine="0",model_name="verifier"} 1.7e9
python_gc_objects_collected_total{generation="0"} 123.0
"""


def test_metrics_are_summed_over_engines_and_kv_usage_is_the_fullest_engine():
    assert parse_metrics(VLLM_METRICS) == ServerSignals(kv_usage=0.93, running=8.0, waiting=2.0, preemptions=5.0)
    assert parse_metrics("fake_requests_total 3\n") == ServerSignals()


def test_ceiling_is_a_positive_integer_or_auto():
    assert parse_ceiling(12) == 12 and parse_ceiling("auto") == AUTO_CEILING
    for bad in (0, -3, "12", True, 2.5):
        with pytest.raises(ValueError, match="positive integer or 'auto'"):
            parse_ceiling(bad)


async def run_requests(limit: Concurrency, n: int, serve) -> int:
    """n requests through `limit`; `serve(limit)` returns the outcome of one (after a short
    await). Returns the most requests in flight at once."""
    peak = 0

    async def one():
        nonlocal peak
        while True:
            async with limit.slot() as report:
                peak = max(peak, limit.in_flight)
                outcome = await serve(limit)
                report(outcome, 0.01, 10)
            if outcome == OK:
                return

    await asyncio.gather(*(one() for _ in range(n)))
    return peak


def test_a_fixed_limit_holds_exactly_its_size_whatever_happens():
    limit = Concurrency(6, adaptive=False)

    async def overloaded(limit):
        await asyncio.sleep(0.001)
        return OVERLOAD if random.random() < 0.3 else OK

    peak = asyncio.run(run_requests(limit, 200, overloaded))
    assert peak == 6 and limit.current == 6 and limit.decreases == 0


class Capacity:
    """A server that holds `capacity` requests and refuses (503) any above it."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.held = 0
        self.refused = 0

    async def __call__(self, limit) -> str:
        if self.held >= self.capacity:
            self.refused += 1
            await asyncio.sleep(0)
            return OVERLOAD
        self.held += 1
        try:
            await asyncio.sleep(0.002)
        finally:
            self.held -= 1
        return OK


def test_adaptive_limit_settles_below_the_servers_capacity_and_loses_nothing():
    server = Capacity(10)
    limit = Concurrency(64, adaptive=True)
    asyncio.run(run_requests(limit, 3000, server))
    late = [point[1] for point in limit.trace[len(limit.trace) // 2 :]]
    # AIMD's sawtooth: between half the capacity and a little above it, never at the ceiling.
    assert min(late) >= 10 * 0.5 - 1 and max(late) <= 10 + 2, late
    assert limit.decreases >= 2 and server.refused < 0.1 * 3000


def test_adaptive_limit_grows_to_the_ceiling_when_nothing_pushes_back():
    limit = Concurrency(24, adaptive=True)
    assert limit.current == INITIAL
    asyncio.run(run_requests(limit, 600, Capacity(1000)))
    assert limit.current == 24 and limit.decreases == 0


def test_an_unused_limit_does_not_grow():
    """Requests sent one at a time never fill the slots: the limit says nothing about the
    server, so it stays where it is."""
    limit = Concurrency(64, adaptive=True)

    async def serial():
        for _ in range(50):
            async with limit.slot() as report:
                await asyncio.sleep(0)
                report(OK, 0.01, 10)

    asyncio.run(serial())
    assert limit.current == INITIAL


def test_congestion_of_requests_sent_before_a_decrease_counts_once():
    limit = Concurrency(64, adaptive=True)
    limit.limit = 32.0

    async def burst():
        gates = asyncio.Event()
        reports = []

        async def one():
            async with limit.slot() as report:
                await gates.wait()
                reports.append(report)
                report(OVERLOAD)

        tasks = [asyncio.create_task(one()) for _ in range(32)]
        await asyncio.sleep(0.01)
        gates.set()
        await asyncio.gather(*tasks)

    asyncio.run(burst())
    assert limit.decreases == 1 and limit.current == 16


def test_preemptions_decrease_once_per_window_and_a_long_queue_holds():
    limit = Concurrency(64, adaptive=True)
    limit.limit = 20.0
    limit.observe(ServerSignals(kv_usage=0.5, running=4, waiting=0, preemptions=0))
    limit.observe(ServerSignals(kv_usage=0.95, running=4, waiting=0, preemptions=3))
    # No request has finished since the limit was set: nothing of this window to blame yet.
    assert limit.current == 20

    async def one_request(outcome=OK):
        async with limit.slot() as report:
            await asyncio.sleep(0)
            report(outcome, 0.01, 10)

    asyncio.run(one_request())
    limit.observe(ServerSignals(kv_usage=0.95, running=4, waiting=0, preemptions=5))
    assert limit.current == 10 and limit.decreases == 1 and limit.preemptions_seen == 5
    limit.observe(ServerSignals(kv_usage=0.95, running=4, waiting=0, preemptions=9))
    assert limit.current == 10, "a second cut in the same window"

    async def full_window():
        await asyncio.gather(*(one_request() for _ in range(40)))

    # Every slot in use and replies fine, but 3 of 10 requests wait in the server: hold.
    limit.observe(ServerSignals(kv_usage=0.99, running=10, waiting=3, preemptions=9))
    asyncio.run(full_window())
    assert limit.current == 10
    # A full KV cache with a short queue is a busy server, not pressure: grow.
    limit.observe(ServerSignals(kv_usage=0.99, running=10, waiting=1, preemptions=9))
    asyncio.run(full_window())
    assert limit.current > 10


def test_waiters_are_admitted_in_order_and_a_cancelled_waiter_gives_nothing_away():
    limit = Concurrency(1, adaptive=False)
    order = []

    async def scenario():
        release = asyncio.Event()

        async def holder():
            async with limit.slot():
                await release.wait()

        async def waiter(name):
            async with limit.slot():
                order.append(name)

        first = asyncio.create_task(holder())
        await asyncio.sleep(0)
        waiters = [asyncio.create_task(waiter(n)) for n in "abc"]
        await asyncio.sleep(0)
        waiters[1].cancel()
        release.set()
        await first
        await asyncio.gather(*waiters, return_exceptions=True)

    asyncio.run(scenario())
    assert order == ["a", "c"] and limit.in_flight == 0


def test_summary_traces_the_limit_over_time():
    limit = Concurrency(8, adaptive=True)
    asyncio.run(run_requests(limit, 200, Capacity(1000)))
    summary = limit.summary()
    assert summary["ceiling"] == 8 and summary["final"] == 8 and summary["adaptive"] is True
    times = [t for t, _, _ in summary["trace"]]
    limits = [c for _, c, _ in summary["trace"]]
    assert times == sorted(times) and limits[0] == INITIAL and limits[-1] == 8


def test_a_dead_server_does_not_cut_the_limit():
    """Refused connections while a server restarts fail at once, retry after retry: they say
    nothing about capacity (the recovery handles them), so the limit stays where it was."""
    limit = Concurrency(64, adaptive=True)
    limit.limit = 16.0

    async def refused_many_times():
        for _ in range(20):
            async with limit.slot() as report:
                report(DISCONNECT)

    asyncio.run(refused_many_times())
    assert limit.current == 16 and limit.decreases == 0


def test_the_limit_stops_at_one_without_counting_more_cuts():
    limit = Concurrency(8, adaptive=True)

    async def refused_again_and_again():
        for _ in range(12):
            async with limit.slot() as report:
                report(OVERLOAD)

    asyncio.run(refused_again_and_again())
    assert limit.current == 1 and limit.decreases == 2  # 4 -> 2 -> 1, then nothing left to cut


def test_the_kv_cache_size_sets_a_floor_for_slow_start_and_cuts():
    """24 blocks of 128 tokens hold 8 requests of up to 300 tokens (3 blocks each) at once:
    the limit starts there, a preemption halves only the probe above it, and no cut goes
    below it."""
    text = VLLM_METRICS + 'vllm:cache_config_info{block_size="128",engine="0",num_gpu_blocks="24"} 1.0\n'
    signals = parse_metrics(text)
    assert (signals.kv_blocks, signals.block_size) == (24.0, 128)
    limit = Concurrency(64, adaptive=True, request_tokens=300)
    assert limit.current == INITIAL
    limit.observe(signals)
    assert limit.floor == 8 and limit.current == 8
    limit.limit = 12.0

    async def one_request():
        async with limit.slot() as report:
            await asyncio.sleep(0)
            report(OK, 0.01, 10)

    preemptions = signals.preemptions
    asyncio.run(one_request())  # a request of the current window has finished
    for _ in range(2):  # two readings in one window: one cut
        preemptions += 10
        limit.observe(ServerSignals(kv_blocks=24, block_size=128, preemptions=preemptions))
    assert limit.current == 10 and limit.decreases == 1  # 8 + (12 - 8) / 2
    for _ in range(5):
        asyncio.run(one_request())  # a request of the current window has finished
        preemptions += 10
        limit.observe(ServerSignals(kv_blocks=24, block_size=128, preemptions=preemptions))
    assert limit.current == 8 and limit.decreases == 3  # 10 -> 9 -> 8.5, then at the floor
    # Without request_tokens (or a fixed limit, or no cache size) there is no floor.
    for other in (Concurrency(64, adaptive=True), Concurrency(64, adaptive=False, request_tokens=300)):
        other.observe(signals)
        assert other.floor == 1
    # A cache that holds more than the ceiling: the ceiling from the start.
    big = Concurrency(16, adaptive=True, request_tokens=300)
    big.observe(ServerSignals(kv_blocks=1000, block_size=16))
    assert big.current == 16


def test_time_per_token_holds_only_without_vllm_metrics():
    """Replies that take ever longer per token (a batch growing on a busy server) hold the
    limit of a server without metrics; from vLLM, whose queue and preemptions say more, they
    do not."""

    async def run(limit: Concurrency, metrics: bool) -> None:
        if metrics:
            limit.observe(ServerSignals(running=1, waiting=0, preemptions=0))
        for _ in range(20):

            async def one():
                async with limit.slot() as report:
                    await asyncio.sleep(0)
                    report(OK, 0.01 * limit.in_flight * limit.current, 10)  # slower as the batch grows

            await asyncio.gather(*(one() for _ in range(limit.current)))

    without, with_metrics = Concurrency(64, adaptive=True), Concurrency(64, adaptive=True)
    asyncio.run(run(without, metrics=False))
    asyncio.run(run(with_metrics, metrics=True))
    # One step per round (the slots of a round free one by one); held after a few without metrics.
    assert with_metrics.current == INITIAL + 20 and without.current <= 10
