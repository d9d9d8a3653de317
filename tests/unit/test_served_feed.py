"""The served mode's feed (train/feed.py) and its checks (train/served.py), without a server:
the bound on bytes in flight, the order and completeness of what the trainer takes, and what
a sample whose states are late, truncated or not finite costs (refused, counted, asked for
again, never trained on). The transfer below injects those faults, which a real vLLM cannot
be made to produce on demand; tests/integration/test_served_states.py runs the real one."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from eagleflow.train.feed import FeedError, StatesFeed
from eagleflow.train.online import TokenSample
from eagleflow.train.served import (
    RefusedStates,
    ServedStates,
    ServedStatesError,
    TransferTimeout,
    check_states,
)
from eagleflow.train.served_servers import served_spec

NUM_AUX, HIDDEN = 2, 4


def token_sample(i: int, n: int = 5) -> TokenSample:
    return TokenSample(f"s{i}", list(range(i, i + n)), [0] + [1] * (n - 1))


def states_of(item: TokenSample) -> dict[str, torch.Tensor]:
    n = len(item.input_ids)
    stacked = torch.arange(n * (NUM_AUX + 1) * HIDDEN, dtype=torch.float32).reshape(n, NUM_AUX + 1, HIDDEN)
    return {"hidden_states": stacked.to(torch.bfloat16), "token_ids": torch.tensor(item.input_ids)}


# --- the feed -------------------------------------------------------------------------------


def test_the_feed_keeps_the_bytes_in_flight_within_its_bound_and_hands_batches_over_in_order():
    taken = 0  # batches the trainer has taken (this thread)
    asked: list[tuple[int, int]] = []  # (the sample's batch, batches taken when it was asked for)

    async def fetch(item: TokenSample) -> str:
        asked.append((int(item.id[1:]) // 4, taken))
        await asyncio.sleep(0.001)
        return item.id

    batches = [[token_sample(4 * b + i) for i in range(4)] for b in range(6)]
    # 10 bytes a sample, 25 allowed: no batch of 4 fits.
    feed = StatesFeed(fetch, lambda item: 10, max_bytes=25, concurrency=8)
    feed.expect(batches)
    got = []
    for batch in batches:
        got.append(feed.take(batch))
        taken += 1
    feed.close()
    assert got == [[s.id for s in b] for b in batches]
    # The batch the trainer takes next goes whole; nothing of the one after it is asked for
    # while it is in flight (40 bytes, over the bound): at most one batch ahead of the trainer.
    assert feed.stats.peak_bytes_in_flight == 40
    assert all(batch <= done + 1 for batch, done in asked), asked
    assert feed.stats.received == feed.stats.requested == 24
    assert feed.stats.server_wait_s > 0


def test_the_feed_asks_ahead_of_the_trainer_up_to_its_bound():
    asked: list[str] = []

    async def fetch(item: TokenSample) -> str:
        asked.append(item.id)
        return item.id

    batches = [[token_sample(b)] for b in range(10)]
    feed = StatesFeed(fetch, lambda item: 10, max_bytes=30, concurrency=4)
    feed.expect(batches)
    first = feed.take(batches[0])
    # Before the trainer took anything more: three samples asked for (the bound), no fourth.
    for _ in range(200):
        if len(asked) >= 4:
            break
        threading.Event().wait(0.01)
    assert first == ["s0"] and asked[:4] == ["s0", "s1", "s2", "s3"] and len(asked) == 4
    for batch in batches[1:]:
        feed.take(batch)
    feed.close()
    assert asked == [f"s{b}" for b in range(10)]


def test_a_fetch_that_fails_fails_the_batch_that_needs_it_with_its_error():
    async def fetch(item: TokenSample) -> str:
        if item.id == "s3":
            raise ServedStatesError("sample s3: no usable states")
        return item.id

    batches = [[token_sample(b)] for b in range(6)]
    feed = StatesFeed(fetch, lambda item: 1, max_bytes=100, concurrency=2)
    feed.expect(batches)
    assert [feed.take(b) for b in batches[:3]] == [["s0"], ["s1"], ["s2"]]
    with pytest.raises(FeedError, match="sample s3"):
        feed.take(batches[3])
    feed.close()


# --- the checks -----------------------------------------------------------------------------


def test_the_checks_refuse_truncated_foreign_and_non_finite_states():
    item = token_sample(0)
    good = states_of(item)
    assert torch.equal(check_states(item, good, NUM_AUX, HIDDEN), good["hidden_states"])
    short = {"hidden_states": good["hidden_states"][:3], "token_ids": good["token_ids"][:3]}
    with pytest.raises(RefusedStates) as refused:
        check_states(item, short, NUM_AUX, HIDDEN)
    assert refused.value.kind == "truncated" and "s0" in str(refused.value)
    other = {**good, "token_ids": good["token_ids"] + 1}
    with pytest.raises(RefusedStates) as refused:
        check_states(item, other, NUM_AUX, HIDDEN)
    assert refused.value.kind == "mismatch"
    cut = {**good, "hidden_states": good["hidden_states"][:, :NUM_AUX]}
    with pytest.raises(RefusedStates) as refused:
        check_states(item, cut, NUM_AUX, HIDDEN)
    assert refused.value.kind == "truncated"
    nan = {**good, "hidden_states": good["hidden_states"].clone()}
    nan["hidden_states"][2, 1, 3] = float("nan")
    with pytest.raises(RefusedStates) as refused:
        check_states(item, nan, NUM_AUX, HIDDEN)
    assert refused.value.kind == "nonfinite" and "1 states" in str(refused.value)


# --- a sample's faults through ServedStates' fetch ------------------------------------------


class FaultyTransfer:
    """Hands each sample's states over after the faults planned for it, in order."""

    def __init__(self, faults: dict[str, list[str]]):
        self.faults = faults
        self.deleted: list[str] = []
        self.items: dict[str, TokenSample] = {}

    def handle(self, params):
        return params["handle"]

    def get(self, params, timeout_s):
        item = self.items[params["handle"]]
        planned = self.faults.get(item.id, [])
        fault = planned.pop(0) if planned else None
        states = states_of(item)
        if fault == "late":
            raise TransferTimeout(f"{params['handle']} did not arrive within {timeout_s:.0f} s")
        if fault == "nan":
            states["hidden_states"][0, 0, 0] = float("inf")
        if fault == "short":
            states = {k: v[:-1] for k, v in states.items()}
        return states

    def delete(self, handle):
        self.deleted.append(handle)


class EchoClient:
    """What the extraction server answers: a handle per request."""

    def __init__(self, transfer: FaultyTransfer):
        self.transfer = transfer
        self.requests = 0

    async def completion(self, payload):
        self.requests += 1
        handle = f"h{self.requests}"
        self.transfer.items[handle] = next(s for s in self.transfer.all if s.input_ids == payload["prompt"])
        return {"kv_transfer_params": {"handle": handle}}


def faulty_source(faults: dict[str, list[str]], retries: int, items: list[TokenSample]) -> ServedStates:
    """ServedStates' fetch and checks over the transfer above; nothing launched."""
    from concurrent.futures import ThreadPoolExecutor

    from eagleflow.train.data import shift
    from eagleflow.train.feed import FeedStats

    source = ServedStates.__new__(ServedStates)
    transfer = FaultyTransfer(faults)
    transfer.all = items
    source.transfer = transfer
    source._client = EchoClient(transfer)
    source._urls = ["http://127.0.0.1:1"]
    source._pool = ThreadPoolExecutor(1)
    source.aux_layer_ids = list(range(NUM_AUX))
    source.hidden_size = HIDDEN
    source.dtype = "bfloat16"
    source.store_dtype = torch.bfloat16
    source.align = shift
    source.stats = FeedStats()
    source.received = {}
    source.server = type("Server", (), {"served_model_name": "m"})()
    source.settings = type("Settings", (), {"retries": retries, "transfer_timeout_s": 1.0, "transfer": "test"})()
    return source


def test_late_truncated_and_non_finite_states_are_refused_counted_and_asked_for_again():
    items = [token_sample(i) for i in range(4)]
    faults = {"s1": ["late"], "s2": ["nan", "short"]}
    source = faulty_source(faults, retries=2, items=items)
    got = [asyncio.run(source._fetch(item)) for item in items]
    assert source.stats.counts == {"transfer_timeouts": 1, "refused_nonfinite": 1, "refused_truncated": 1}
    # Each sample trained on once, with its own good states; every handle read was deleted.
    assert source.received == {"s0": 1, "s1": 1, "s2": 1, "s3": 1}
    assert source._client.requests == 7 and len(source.transfer.deleted) == 7
    for item, sample in zip(items, got, strict=True):
        expected = states_of(item)["hidden_states"].float()
        assert torch.equal(sample.hidden_states, expected[:-1, :NUM_AUX].reshape(4, -1))
        assert torch.isfinite(sample.hidden_states).all()


def test_a_sample_whose_states_never_arrive_fails_the_job_naming_it_after_its_retries():
    items = [token_sample(0)]
    source = faulty_source({"s0": ["late", "late", "late"]}, retries=2, items=items)
    with pytest.raises(ServedStatesError, match=r"sample s0: no usable states after 3 requests"):
        asyncio.run(source._fetch(items[0]))
    assert source.received == {} and source.stats.counts == {"transfer_timeouts": 3}


def test_the_served_server_is_the_offline_backends_with_the_mooncake_connector_in_place_of_files():
    import yaml

    from eagleflow.hidden_states.vllm import extraction_server_args
    from eagleflow.runtime.spec import ServerConfig
    from tests.helpers import REPO

    server = ServerConfig.from_section(yaml.safe_load((REPO / "config/config.yaml").read_text())["server"])
    file_spec = served_spec(server, "/v", [1, 2], 4, False, "/tmp/x", None)
    speculative, extra = extraction_server_args([1, 2], 4, "/tmp/x")
    assert file_spec.speculative_config == speculative and file_spec.extra_args[-len(extra) :] == tuple(extra)
    mooncake = {"kv_connector": "EagleflowMooncakeConnector"}
    spec = served_spec(server, "/v", [1, 2], 4, False, "/tmp/x", mooncake)
    flag = spec.extra_args.index("--kv-transfer-config")
    assert spec.speculative_config == speculative
    assert spec.extra_args[flag + 1] == '{"kv_connector": "EagleflowMooncakeConnector"}'
    assert [a for a in spec.extra_args if a != spec.extra_args[flag + 1]] == [
        a for a in file_spec.extra_args if a != file_spec.extra_args[flag + 1]
    ]
    assert spec.scratch_dirs == () and file_spec.scratch_dirs == ("/tmp/x",)


def test_the_training_processes_summaries_merge_into_one_row():
    """Several data-parallel processes each count what they fetched; the stats row adds the
    counts up and keeps the largest peak and waits, and counts each sample's arrivals over all
    of them (an eval sample every process asked for arrives once per process)."""
    items = [token_sample(i) for i in range(3)]
    first, second = faulty_source({}, 0, items), faulty_source({}, 0, items)
    first.stats.requested, first.stats.received, first.stats.peak_bytes_in_flight = 2, 2, 100
    second.stats.requested, second.stats.received, second.stats.peak_bytes_in_flight = 3, 3, 70
    first.stats.count("refused_nonfinite")
    first.received, second.received = {"s0": 1, "e": 1}, {"s1": 1, "s2": 1, "e": 1}
    merged = first.summary([first.part(), second.part()])
    assert merged["processes"] == 2 and merged["requested"] == 5 and merged["received"] == 5
    assert merged["peak_bytes_in_flight"] == 100 and merged["refused_nonfinite"] == 1
    assert merged["samples_received_times"] == {"1": 3, "2": 1}
    assert first.summary()["samples_received_times"] == {"1": 2} and first.summary()["processes"] == 1
