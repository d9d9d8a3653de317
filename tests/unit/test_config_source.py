"""One source for each config key: its type, bounds and description are the schema's, its
default config/config.yaml's. config/README.md's reference tables are generated from the two
(devkit/config_reference.py) and the typed sections (the dataclasses the jobs read their
sections into) are held to the schema: a drift in any of them fails here, naming the key.
Whether a key changes results is the schema's `x-changes-results`; the integration run holds
the keys it clears to planning no job (tests/integration/test_pipeline.py)."""

import copy
import re
import types
import typing

import pytest
import yaml

from devkit import config_reference as ref
from eagleflow.benchmark.parity_checks import ParityConfig
from eagleflow.benchmark.workload import BenchmarkConfig
from eagleflow.common.config import typed, validate_config
from eagleflow.dag.plan.hours import Rates
from eagleflow.dag.rule_params import STAGE_NAMES
from eagleflow.dataset import DatasetConfig
from eagleflow.hidden_states.backend import HiddenStatesConfig, VllmExtractionConfig
from eagleflow.prompts.config import FilterConfig, PromptsConfig, WrittenConfig
from eagleflow.runtime.spec import ServerConfig
from eagleflow.train.config import TrainConfig
from eagleflow.train.served_servers import MooncakeSettings, ServedSettings
from eagleflow.vocab import VocabConfig

# Every typed section: the dataclass a job reads the section into, by the section's key.
TYPED = {
    "server": ServerConfig,
    "prompts": PromptsConfig,
    "prompts.written": WrittenConfig,
    "prompts.filters": FilterConfig,
    "dataset": DatasetConfig,
    "vocab": VocabConfig,
    "hidden_states": HiddenStatesConfig,
    "hidden_states.vllm": VllmExtractionConfig,
    "hidden_states.served": ServedSettings,
    "hidden_states.served.mooncake": MooncakeSettings,
    "train": TrainConfig,
    "benchmark": BenchmarkConfig,
    "parity": ParityConfig,
    "throughput": Rates,
}


# Subsections a section's jobs never receive, typed apart for the job that reads them
# (workflow/rules: section_without): served mode's transfer, the train job's.
TYPED_APART = {"hidden_states": {"served"}}


def section_schema(schema, key):
    prop = {"properties": schema["properties"]}
    for part in key.split("."):
        prop = ref.resolved(prop["properties"][part], schema["$defs"])
    return prop


def schema_types(prop, defs) -> set[str]:
    """The JSON types a property admits."""
    prop = ref.resolved(prop, defs)
    if "oneOf" in prop or "anyOf" in prop:
        return set().union(*(schema_types(p, defs) for p in prop.get("oneOf", prop.get("anyOf"))))
    if "const" in prop:
        return {json_type(prop["const"])}
    if "enum" in prop:
        return {json_type(v) for v in prop["enum"]}
    kind = prop.get("type")
    return set(kind) if isinstance(kind, list) else {kind}


def json_type(value) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", type(None): "null"}[type(value)]


def hint_types(hint) -> set[str]:
    """The JSON types a field's annotation holds (a list or tuple is an array, a dataclass or a
    mapping an object; Any is any)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return set().union(*(hint_types(a) for a in typing.get_args(hint)))
    if typing.get_origin(hint) is typing.Literal:
        return {json_type(a) for a in typing.get_args(hint)}
    if hint is typing.Any:
        return {"any"}
    origin = typing.get_origin(hint) or hint
    if origin in (list, tuple):
        return {"array"}
    if origin in (dict, typing.Mapping) or hasattr(origin, "__dataclass_fields__"):
        return {"object"}
    return {{int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null"}[origin]}


def test_the_readme_tables_are_the_schemas_descriptions_and_the_defaults():
    readme, schema, config = ref.load()
    assert ref.drift(readme, schema, config) == [], "run `python -m devkit.config_reference --write`"


def test_every_key_the_reference_documents_has_a_description():
    _, schema, config = ref.load()
    assert all("description" in p for p in ref.documented_keys(schema).values())
    validate_config(config)  # the defaults are of the schema's types and bounds


@pytest.mark.parametrize("key", sorted(TYPED))
def test_each_typed_section_has_the_schemas_keys_and_types(key):
    _, schema, config = ref.load()
    cls, section = TYPED[key], section_schema(schema, key)
    hints = typing.get_type_hints(cls)
    fields = set(cls.__dataclass_fields__)
    # A key the stage reads by its old name is that field (dag.rule_params.STAGE_NAMES).
    stage_names = STAGE_NAMES.get(key, {})
    config_key = {stage_names.get(k, k): k for k in section["properties"]}
    keys = set(config_key) - TYPED_APART.get(key, set())
    assert fields == keys, f"{key}: {cls.__name__}'s fields against the schema's keys"
    for name in fields:
        admitted = schema_types(section["properties"][config_key[name]], schema["$defs"])
        held = hint_types(hints[name])
        assert held == {"any"} or held == admitted, (
            f"{key}.{name}: the schema admits {sorted(admitted)}, {cls.__name__} holds {sorted(held)}"
        )
    defaults = {stage_names.get(k, k): v for k, v in ref.default_of(config, key).items()}
    defaults = {k: v for k, v in defaults.items() if k in keys}
    typed(cls, defaults, key)  # the defaults read into it


def test_a_default_changed_in_the_source_is_a_named_drift_in_the_readme():
    """The issue's check: a changed default (config.yaml) or description (the schema) must
    show in the generated tables, by key, until they are written again."""
    readme, schema, config = ref.load()
    changed = copy.deepcopy(config)
    changed["train"]["lr"] = config["train"]["lr"] * 2
    assert [d.split(":")[0] for d in ref.drift(readme, schema, changed)] == ["train.lr"]
    described = copy.deepcopy(schema)
    described["properties"]["train"]["properties"]["epochs"]["description"] = "passes over the data"
    assert [d.split(":")[0] for d in ref.drift(readme, described, config)] == ["train.epochs"]
    rewritten = ref.rendered(readme, described, changed)
    assert ref.drift(rewritten, described, changed) == []
    assert "| `train.epochs` | " in rewritten and "passes over the data |" in rewritten


def test_a_typed_section_that_drifts_from_the_schema_fails_by_key(monkeypatch):
    _, schema, _ = ref.load()
    dropped = copy.deepcopy(schema)
    del dropped["properties"]["vocab"]["properties"]["draft_vocab_size"]
    monkeypatch.setattr(ref, "load", lambda: (None, dropped, yaml.safe_load(ref.DEFAULTS.read_text())))
    with pytest.raises(AssertionError, match="vocab: VocabConfig's fields"):
        test_each_typed_section_has_the_schemas_keys_and_types("vocab")
    retyped = copy.deepcopy(schema)
    retyped["properties"]["train"]["properties"]["lr"] = {"type": "integer", "description": "x"}
    monkeypatch.setattr(ref, "load", lambda: (None, retyped, yaml.safe_load(ref.DEFAULTS.read_text())))
    with pytest.raises(
        AssertionError, match=r"train.lr: the schema admits \['integer'\], TrainConfig holds \['number'\]"
    ):
        test_each_typed_section_has_the_schemas_keys_and_types("train")


def test_a_key_marked_as_changing_no_result_shows_so_and_the_rules_it_still_reruns():
    _, schema, config = ref.load()
    schema = copy.deepcopy(schema)
    prop = schema["properties"]["train"]["properties"]["lr"]
    assert ref.changes_results("train.lr", prop, ref.whole_section_rules()) == "yes"
    prop["x-changes-results"] = False
    # train takes its section whole (draft_section("train")): the key still reruns it.
    assert "| `train.lr` | `0.001` | no (reruns train) |" in "\n".join(ref.tables(schema, config)["train"])
    assert "train.lr" not in ref.run_only_keys(schema, ref.whole_section_rules())


def test_the_rules_that_take_a_section_whole_are_read_from_the_rule_files(tmp_path):
    (tmp_path / "a.smk").write_text(
        'rule one:\n    params:\n        x=rule_params.section_param(config, "dataset"),\n'
        '        y=draft_section("train"),\n'
        'rule two:\n    params:\n        z=variant_section("dataset"),\n        w=written_section(),\n'
        'rule three:\n    params:\n        h=rule_params.section_param(config, "hidden_states", ["served"]),\n'
        'rule four:\n    params:\n        h=rule_params.section_param(config, "hidden_states"),\n'
    )
    assert ref.whole_section_rules(tmp_path) == {
        "dataset": ["one", "two"],
        "train": ["one"],
        "hidden_states": ["four", "three"],
        "hidden_states.served": ["four"],
    }


def test_every_rerun_the_source_names_is_a_rule_and_only_for_keys_that_change_no_result():
    _, schema, _ = ref.load()
    rules = {r for rs in ref.whole_section_rules().values() for r in rs}
    rules |= set(re.findall(r"(?m)^rule (\w+):", "".join(p.read_text() for p in ref.RULES.glob("*.smk"))))
    for key, prop in ref.documented_keys(schema).items():
        if "x-reruns" in prop:
            assert prop.get("x-changes-results") is False, key
            assert set(prop["x-reruns"]) <= rules, key


def test_the_hidden_state_keys_that_change_no_result_are_not_in_a_samples_key():
    """A stored sample's key (hidden_states.run.content_settings) leaves out the operational
    settings: every hidden_states key the source says changes no result is one of them, or in a
    subsection the extraction jobs never receive (TYPED_APART)."""
    from eagleflow.hidden_states.run import OPERATIONAL

    _, schema, _ = ref.load()
    stage_names = STAGE_NAMES["hidden_states"]
    marked = {
        stage_names.get(key.split(".")[1], key.split(".")[1])
        for key, prop in ref.documented_keys(schema).items()
        if key.startswith("hidden_states.") and prop.get("x-changes-results") is False
    } - TYPED_APART["hidden_states"]
    assert marked and marked <= OPERATIONAL, marked - OPERATIONAL
