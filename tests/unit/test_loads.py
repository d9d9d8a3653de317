"""Verifier loads: planned from the jobs a run will run, counted from the launches it made."""

import copy
from pathlib import Path

import yaml

from eagleflow.dag.plan.loads import describe_planned, planned_loads
from eagleflow.dag.variants import merged
from eagleflow.runtime.ledger import count_loads, read_loads, record_load
from tests.helpers import REPO

CONFIG = yaml.safe_load((REPO / "config/config.yaml").read_text())
FULL_RUN = {
    "prepare_verifier": 1,
    "generate": 1,
    "synth": 1,
    "hidden_states": 1,
    "hidden_states_index": 1,
    "train": 1,
    "baseline": 1,
    "benchmark": 1,
    "report": 1,
    "compare": 1,
}


def test_a_full_run_loads_once_per_serving_stage_and_once_per_extraction_node():
    assert planned_loads(FULL_RUN, CONFIG) == {"generate": 1, "hidden_states": 1, "baseline": 1, "benchmark": 1}
    assert describe_planned(FULL_RUN, CONFIG) == (
        "Verifier loads this run takes: 4 (generate 1, hidden_states 1, baseline 1, benchmark 1)"
    )
    # Over 4 nodes: one extraction job and one load on each.
    assert planned_loads({**FULL_RUN, "hidden_states": 4}, CONFIG)["hidden_states"] == 4


def test_prompts_the_verifier_writes_take_a_load_of_their_own():
    assert planned_loads({**FULL_RUN, "write_prompts": 1}, CONFIG)["write_prompts"] == 1


def test_a_retrain_loads_only_for_its_benchmark_and_endpoints_load_nothing():
    assert planned_loads({"train": 1, "benchmark": 1, "report": 1}, CONFIG) == {"benchmark": 1}
    online = merged(CONFIG, {"hidden_states": {"mode": "online"}})
    assert planned_loads({"train": 2, "benchmark": 2}, online) == {"train": 2, "benchmark": 2}
    with_endpoints = copy.deepcopy(CONFIG)
    with_endpoints["server"]["endpoint"] = "http://gpu-node:8000"
    with_endpoints["hidden_states"]["backend"] = "vllm"
    with_endpoints["hidden_states"]["vllm"]["endpoint"] = "http://gpu-node:8001"
    assert planned_loads(FULL_RUN, with_endpoints) == {"baseline": 1, "benchmark": 1}
    assert planned_loads({**FULL_RUN, "write_prompts": 1}, with_endpoints) == {"baseline": 1, "benchmark": 1}
    assert describe_planned({"report": 1}, CONFIG) == "Verifier loads this run takes: 0"


def test_the_parity_jobs_of_every_variant_share_one_load():
    variants = {**FULL_RUN, "benchmark": 4, "parity": 4, "report": 4}
    assert planned_loads(variants, CONFIG)["parity"] == 1
    assert describe_planned(variants, CONFIG).endswith("benchmark 4, parity 1 (shared by 4 parity jobs))")


def test_launches_are_counted_by_stage_and_kind(tmp_path):
    assert read_loads(tmp_path) == []
    record_load(tmp_path, Path("logs/generate.vllm.log"), "m", "start", False)
    record_load(tmp_path, Path("logs/generate.vllm.log"), "m", "restart", False)
    record_load(tmp_path, Path("logs/hidden_states.server.log"), "m", "start", True)
    assert count_loads(read_loads(tmp_path)) == {"generate": {"start": 1, "restart": 1}, "hidden_states": {"start": 1}}


def test_rules_imported_under_a_prefix_count_as_eagleflows():
    from eagleflow.dag.plan.loads import by_eagleflow_rule

    config = yaml.safe_load((REPO / "config/config.yaml").read_text())
    assert by_eagleflow_rule({"eagleflow_hidden_states": 2, "eagleflow_hidden_states_index": 1}) == {
        "hidden_states": 2,
        "eagleflow_hidden_states_index": 1,
    }
    assert planned_loads({"eagleflow_generate": 1, "eagleflow_baseline": 1}, config) == planned_loads(
        {"generate": 1, "baseline": 1}, config
    )
