"""Typed config: every section's dataclass has exactly the schema's keys, config.yaml builds
every one, and a mismatch names the key."""

import dataclasses

import pytest
import yaml

from devkit.configs import config_section, extraction_section
from eagleflow.benchmark.workload import BenchmarkConfig
from eagleflow.common.config import ConfigError, typed
from eagleflow.dag.rule_params import STAGE_NAMES, section_param
from eagleflow.dataset import DatasetConfig
from eagleflow.hidden_states.backend import HiddenStatesConfig, VllmExtractionConfig
from eagleflow.prompts.config import PromptsConfig
from eagleflow.runtime.spec import ServerConfig
from eagleflow.synth.run import Parsing
from eagleflow.train.config import TrainConfig
from eagleflow.vocab import VocabConfig
from tests.helpers import REPO

SECTIONS = {
    "server": ServerConfig,
    "prompts": PromptsConfig,
    "dataset": DatasetConfig,
    "vocab": VocabConfig,
    "hidden_states": HiddenStatesConfig,
    "train": TrainConfig,
    "benchmark": BenchmarkConfig,
}
SCHEMA = yaml.safe_load((REPO / "workflow/schemas/config.schema.yaml").read_text())
# Subsections a section's jobs never receive, typed apart for the job that reads them
# (workflow/rules: section_without): served mode's transfer, the train job's ServedSettings.
TYPED_APART = {"hidden_states": {"served"}}


@pytest.mark.parametrize("name", sorted(SECTIONS))
def test_section_dataclass_has_exactly_the_schema_keys_and_builds_from_config_yaml(name):
    cls = SECTIONS[name]
    apart = TYPED_APART.get(name, set())
    # A key the stage reads by its old name is that field (dag.rule_params.STAGE_NAMES).
    names = STAGE_NAMES.get(name, {})
    keys = {names.get(k, k) for k in SCHEMA["properties"][name]["properties"]} - apart
    assert sorted(f.name for f in dataclasses.fields(cls)) == sorted(keys)
    section = section_param({name: config_section(name)}, name, tuple(apart))
    built = typed(cls, section, name)
    assert dataclasses.is_dataclass(built) and cls.__dataclass_params__.frozen


def test_every_schema_key_is_required_so_code_needs_no_default():
    """config.yaml holds every default; the schema requires every key of every section."""

    def check(schema, where):
        if "properties" in schema:
            assert sorted(schema.get("required", [])) == sorted(schema["properties"]), where
            for key, sub in schema["properties"].items():
                check(sub, f"{where}.{key}")

    check(SCHEMA, "config")


def test_missing_and_unknown_keys_are_named():
    section = config_section("train")
    del section["lr"]
    section["learning_rate"] = 0.1
    with pytest.raises(ConfigError, match=r"train\.lr: missing; train\.learning_rate: unknown key"):
        typed(TrainConfig, section, "train")


def test_nested_sections_and_tuples_are_typed():
    hs = typed(
        HiddenStatesConfig, extraction_section(config_section("hidden_states", aux_layer_ids=[1, 3])), "hidden_states"
    )
    assert hs.aux_layer_ids == (1, 3)
    assert (
        isinstance(hs.vllm, VllmExtractionConfig)
        and hs.vllm.concurrency == config_section("hidden_states")["vllm"]["concurrency"]
    )
    with pytest.raises(ConfigError, match=r"hidden_states\.vllm\.port: unknown key"):
        typed(
            HiddenStatesConfig, extraction_section(config_section("hidden_states", vllm={"port": 1})), "hidden_states"
        )


def test_synth_parsing_view_takes_think_markers_as_a_pair():
    synth = config_section("synth", think_markers=["<think>", "</think>"])
    view = {k: synth[k] for k in ("expect_reasoning", "think_markers", "verify_token_ids")}
    view["chat_template_kwargs"] = config_section("generate")["chat_template_kwargs"]
    parsing = typed(Parsing, {**view, "trust_remote_code": False}, "synth")
    assert parsing.think_markers == ("<think>", "</think>")
