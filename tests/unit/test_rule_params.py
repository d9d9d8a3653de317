"""What the rules' params hold (eagleflow/dag/rule_params.py): a key a rule's outputs depend on
moves its param, and a key they do not depend on leaves it as it is (a changed param reruns
the rule: a missing key is a stale result, an extra one a spurious rerun)."""

import pytest

from eagleflow.dag import rule_params as rp
from eagleflow.dag.plan.needs import load_merged_config
from eagleflow.dag.variants import merged
from eagleflow.runtime.spec import ServerConfig, ServerSpec
from tests.helpers import REPO

CONFIG = load_merged_config([], REPO)


def argv(config) -> list[str]:
    return ServerSpec.from_config(ServerConfig.from_section(config["server"]), "resources/verifier/v").command(0)


def moves(param, override) -> bool:
    """Whether `override` (a config overlay) changes what `param(config)` holds."""
    return param(CONFIG) != param(merged(CONFIG, override))


def test_sections_are_blind_to_key_order_at_every_level():
    a = {"b": 1, "a": {"d": [{"y": 1, "x": 2}], "c": 3}}
    b = {"a": {"c": 3, "d": [{"x": 2, "y": 1}]}, "b": 1}
    assert list(rp.sorted_keys(a)) == ["a", "b"] and str(rp.sorted_keys(a)) == str(rp.sorted_keys(b))


@pytest.mark.parametrize(
    "override, expected",
    [
        ({"generate": {"temperature": 0.6}}, True),
        ({"generate": {"max_tokens": 77}}, True),
        ({"generate": {"extra_body": {"top_k": 20}}}, True),
        ({"generate": {"seed": None}}, True),  # unset: the request carries no seed
        ({"generate": {"chat_template_kwargs": {"enable_thinking": False}}}, True),
        ({"server": {"served_model_name": "other"}}, True),
        # How generate runs, not what it asks: concurrency, shards, the store's place.
        ({"generate": {"concurrency": 3}}, False),
        ({"generate": {"shards": 4}}, False),
        ({"generate": {"store": "/elsewhere.sqlite"}}, False),
        ({"synth": {"expect_reasoning": True}}, False),
    ],
)
def test_generates_requests_hold_what_changes_a_request(override, expected):
    assert moves(rp.generate_requests, override) is expected


def test_the_generate_section_is_read_typed():
    """Every key of the schema's `generate` section is a field of GenerateConfig (the params
    read it through it), and a key it does not know is an error naming it."""
    import yaml

    from eagleflow.common.config import ConfigError

    schema = yaml.safe_load((REPO / "workflow/schemas/config.schema.yaml").read_text())
    assert set(schema["properties"]["generate"]["properties"]) == set(CONFIG["generate"])
    assert "seed" not in rp.generate_requests(merged(CONFIG, {"generate": {"seed": None}}))["sampling"]
    with pytest.raises(ConfigError, match="generate.retries: unknown key"):
        rp.generate_requests(merged(CONFIG, {"generate": {"retries": 2}}))


@pytest.mark.parametrize(
    "override, expected",
    [
        ({"synth": {"expect_reasoning": True}}, True),
        ({"synth": {"think_markers": ["<t>", "</t>"]}}, True),
        ({"generate": {"chat_template_kwargs": {"enable_thinking": False}}}, True),
        ({"verifier": {"trust_remote_code": True}}, True),
        ({"generate": {"temperature": 0.6}}, False),  # a request's setting: generate reruns, not synth's parsing
    ],
)
def test_synth_parsing_holds_how_replies_are_read(override, expected):
    assert moves(rp.synth_parsing, override) is expected


def test_the_baseline_is_measured_on_the_workload_not_on_the_drafts_k():
    assert not moves(rp.baseline_workload, {"benchmark": {"num_speculative_tokens": 5}})
    assert not moves(rp.baseline_workload, {"benchmark": {"num_prompts": 8}})  # a set, in the sets' param
    for override in ({"benchmark": {"max_tokens": 64}}, {"benchmark": {"temperatures": [0.0, 0.7]}}):
        assert moves(rp.baseline_workload, override)
    assert moves(rp.baseline_workload, {"generate": {"chat_template_kwargs": {"enable_thinking": False}}})


def test_online_states_reach_training_only_online():
    assert rp.online_states(CONFIG) is None
    assert not moves(rp.online_states, {"hidden_states": {"batch_tokens": 1024}})
    online = merged(CONFIG, {"hidden_states": {"mode": "online"}})
    assert rp.online_states(online)["batch_tokens"] == online["hidden_states"]["batch_tokens"]
    assert rp.online_states(merged(online, {"hidden_states": {"batch_tokens": 1024}})) != rp.online_states(online)
    assert rp.online_states(merged(online, {"hidden_states": {"num_parts": 3}})) == rp.online_states(online)


def test_served_states_reach_training_only_served_and_only_what_shapes_the_states():
    from eagleflow.common.config import ConfigError

    assert rp.served_states(CONFIG, argv(CONFIG)) is None
    served = merged(CONFIG, {"hidden_states": {"mode": "served"}})
    states = rp.served_states(served, argv(served))
    assert states["dtype"] == served["hidden_states"]["dtype"] and ["--dtype", served["server"]["dtype"]] in [
        list(group) for group in states["server_args"]
    ]
    # How the states travel changes none of them: the train job's param stays.
    moved = merged(served, {"hidden_states": {"served": {"transfer": "mooncake", "max_inflight_mb": 1}}})
    assert rp.served_states(moved, argv(moved)) == states
    fp8 = merged(served, {"hidden_states": {"dtype": "float8_e4m3fn"}})
    assert rp.served_states(fp8, argv(fp8)) != states
    with pytest.raises(ConfigError, match="target: topk"):
        topk = merged(served, {"hidden_states": {"target": "topk"}})
        rp.served_states(topk, argv(topk))
    # Several training processes share the launched servers; where and how many changes no state.
    ranks = merged(served, {"train": {"nproc_per_node": 2}, "hidden_states": {"served": {"servers": 3}}})
    assert rp.served_states(ranks, argv(ranks)) == states
    given = merged(ranks, {"hidden_states": {"served": {"endpoints": ["http://127.0.0.1:8000"]}}})
    assert rp.served_states(given, argv(given)) == states
    theirs = merged(given, {"hidden_states": {"served": {"transfer": "mooncake"}}})
    with pytest.raises(ConfigError, match="mooncake.master"):
        rp.served_states(theirs, argv(theirs))
    elsewhere = merged(served, {"hidden_states": {"served": {"placement": "nodes"}}})
    with pytest.raises(ConfigError, match="set transfer: mooncake"):
        rp.served_states(elsewhere, argv(elsewhere))


def test_a_served_train_job_asks_for_its_servers_nodes_or_gpus():
    served = merged(CONFIG, {"hidden_states": {"mode": "served", "served": {"servers": 2}}})
    gpus = merged(served, {"server": {"gpus": 4}, "train": {"gpus": 1}})
    # On its host: its own GPUs and its servers'; one node.
    assert rp.gpus(gpus, "train") == 1 + 2 * 4 and rp.train_nodes(gpus) == 1
    # On nodes of their own: the servers' GPUs are theirs; one node more for each.
    nodes = merged(gpus, {"hidden_states": {"served": {"placement": "nodes", "transfer": "mooncake"}}})
    assert rp.gpus(nodes, "train") == 1 and rp.train_nodes(nodes) == 3
    # Servers it does not launch, or another mode: nothing more.
    named = merged(nodes, {"hidden_states": {"served": {"endpoints": ["http://10.0.0.2:8000"]}}})
    assert rp.gpus(named, "train") == 1 and rp.train_nodes(named) == 1
    offline = merged(nodes, {"hidden_states": {"mode": "offline"}})
    assert rp.gpus(offline, "train") == 1 and rp.train_nodes(offline) == 1


def test_the_server_reaches_states_only_through_the_vllm_backend():
    hf = merged(CONFIG, {"hidden_states": {"backend": "hf"}})
    vllm = merged(CONFIG, {"hidden_states": {"backend": "vllm"}})
    assert rp.hidden_states_server(hf, argv(hf)) == []
    flags = [group[0] for group in rp.hidden_states_server(vllm, argv(vllm))]
    assert "--dtype" in flags and "--port" not in flags
    eager = merged(vllm, {"server": {"enforce_eager": not vllm["server"]["enforce_eager"]}})
    assert rp.hidden_states_server(eager, argv(eager)) != rp.hidden_states_server(vllm, argv(vllm))


def test_the_benchmark_measures_every_server_flag_but_its_port_and_model():
    measured = rp.measured_server(CONFIG, argv(CONFIG))
    assert "--port" not in measured["argv"] and "--model" not in measured["argv"]
    assert "--max-model-len" in measured["argv"]
    env = merged(CONFIG, {"server": {"env": {"OMP_NUM_THREADS": "1"}}})
    assert rp.measured_server(env, argv(env))["env"]["OMP_NUM_THREADS"] == "1"
    assert rp.measured_server(env, argv(env))["argv"] == measured["argv"]


def test_overlap_sets_name_the_standard_sets_and_the_files_and_none_with_the_filter_off():
    sets = {"benchmark": {"sets": [*CONFIG["benchmark"]["sets"], {"name": "mine", "path": "p.jsonl", "size": 3}]}}
    assert rp.overlap_sets(merged(CONFIG, sets)) == [
        {"name": "mt_bench"},
        {"name": "humaneval"},
        {"name": "mine", "path": "p.jsonl"},
    ]
    assert rp.overlap_sets(merged(CONFIG, {"prompts": {"filters": {"benchmark_overlap": None}}})) == []


def test_written_replies_only_between_written_turns_and_their_filters_send_nothing():
    one = merged(CONFIG, {"prompts": {"written": {"turns": 1}}})
    two = merged(CONFIG, {"prompts": {"written": {"turns": 2}}})
    assert rp.written_replies(one) is None and rp.written_replies(two) == rp.generate_requests(two)
    assert not moves(rp.written_section, {"prompts": {"filters": {"min_chars": 1}}})
    assert moves(rp.written_section, {"prompts": {"written": {"count": 3}}})


def test_gpus_per_stage_follow_the_server_unless_it_already_runs():
    gpu = merged(CONFIG, {"server": {"gpus": 8}, "hidden_states": {"backend": "vllm"}, "train": {"gpus": 2}})
    assert (rp.gpus(gpu, "generate"), rp.gpus(gpu, "benchmark"), rp.gpus(gpu, "hidden_states")) == (8, 8, 8)
    assert rp.gpus(gpu, "train") == 2
    running = merged(gpu, {"server": {"endpoint": "http://127.0.0.1:8000/v1"}})
    assert rp.gpus(running, "generate") == 0 and rp.gpus(running, "benchmark") == 8


def test_variant_groups_learning_curves_and_k_checks():
    config = merged(
        CONFIG,
        {
            "variants": {
                "k5": {"benchmark": {"num_speculative_tokens": 5}},
                "half": {"train": {"sample_fraction": 0.5}},
                "k5-lr": {"benchmark": {"num_speculative_tokens": 5}, "train": {"lr": 1e-4}},
            }
        },
    )
    assert rp.k_variants(config) == ["k5"]
    assert rp.learning_curve_variants(config) == ["half"]
    assert rp.generate_shards(merged(CONFIG, {"generate": {"shards": 3}})) == ["0-of-3", "1-of-3", "2-of-3"]


def test_the_extraction_jobs_see_the_section_as_before_the_rename_of_num_shards():
    """hidden_states.num_parts reaches the extraction and parity jobs as num_shards, the name
    the stage's settings have (HiddenStatesConfig, in the code that keys every stored sample):
    their params are what they were, so the rename reruns no job and extracts nothing."""
    param = rp.section_param(merged(CONFIG, {"hidden_states": {"num_parts": 3}}), "hidden_states", ("served",))
    assert param["num_shards"] == 3 and "num_parts" not in param and "served" not in param
    assert list(param) == sorted(param)
    assert moves(lambda c: rp.section_param(c, "hidden_states"), {"hidden_states": {"num_parts": 2}})


def test_a_config_that_still_says_num_shards_is_told_its_new_name():
    rp.check_renamed_keys(CONFIG)
    old = merged(CONFIG, {"hidden_states": {"num_shards": 4}})
    with pytest.raises(rp.ConfigError, match=r"hidden_states\.num_shards: renamed hidden_states\.num_parts"):
        rp.check_renamed_keys(old)


def test_the_plan_refuses_the_old_name_before_the_schema_does(tmp_path):
    old = tmp_path / "old.yaml"
    old.write_text("hidden_states:\n  num_shards: 2\n")
    with pytest.raises(rp.ConfigError, match="set num_parts instead"):
        load_merged_config([str(old)], REPO)
