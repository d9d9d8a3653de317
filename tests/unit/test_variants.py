"""Variants: which drafts a run has, the config each sees, and which jobs they share."""

import pytest
import yaml

from eagleflow.common.config import ConfigError
from eagleflow.dag.variants import (
    check_drafts_servable,
    draft_id,
    merged,
    validate_variants,
    variant_config,
    variant_overrides,
    vocab_id,
)
from tests.helpers import REPO


@pytest.fixture
def config():
    cfg = yaml.safe_load((REPO / "config/config.yaml").read_text())
    cfg["learning_curve"]["fractions"] = [0.5, 0.25, 1.0]
    cfg["variants"] = {
        "lr-low": {"train": {"lr": 0.0001}},
        "vocab-8k": {"vocab": {"draft_vocab_size": 8192}},
        "k2": {"benchmark": {"num_speculative_tokens": 2}},
    }
    return cfg


def test_default_first_then_the_learning_curve_then_the_named_variants(config):
    assert list(variant_overrides(config)) == ["default", "lc-25", "lc-50", "lr-low", "vocab-8k", "k2"]
    assert variant_config(config, "lc-25")["train"]["sample_fraction"] == 0.25
    assert variant_config(config, "lr-low")["train"]["lr"] == 0.0001
    assert variant_config(config, "lr-low")["train"]["epochs"] == config["train"]["epochs"]
    assert variant_config(config, "default") == config


def test_jobs_are_shared_where_the_sections_agree(config):
    assert {v: vocab_id(config, v) for v in ("default", "lc-25", "lr-low", "k2")} == dict.fromkeys(
        ("default", "lc-25", "lr-low", "k2"), "default"
    )
    assert vocab_id(config, "vocab-8k").startswith("v-")
    assert draft_id(config, "k2") == draft_id(config, "default") == "default"
    drafts = {draft_id(config, v) for v in ("lc-25", "lc-50", "lr-low", "vocab-8k")}
    assert len(drafts) == 4 and all(d.startswith("d-") for d in drafts)


def test_a_bad_variant_is_named(config):
    config["variants"]["fast"] = {"train": {"lr": -1}}
    with pytest.raises(ConfigError, match=r"variants\.fast: .*train\.lr: expected > 0, got -1"):
        validate_variants(config)
    config["variants"] = {"lc-25": {"train": {"lr": 0.1}}}
    with pytest.raises(ConfigError, match="learning curve already names a variant lc-25"):
        variant_overrides(config)


def test_settings_vllm_cannot_serve_are_refused_before_any_job(config, tmp_path):
    """An MLA draft with a sliding window or a norm before fc (vLLM's MLA draft layer has
    neither) is refused by the config check, every variant's setting named, before a job would
    extract and train for a draft the benchmark cannot load; without the MLA layer both are fine."""
    config["train"]["sliding_window"] = 64
    config["variants"]["norms"] = {"train": {"norm_before_fc": True}}
    check_drafts_servable(config, str(tmp_path))  # the Llama-shaped draft has both
    config["train"]["draft_attention"] = "mla"
    with pytest.raises(ConfigError) as refused:
        check_drafts_servable(config, str(tmp_path))
    message = str(refused.value)
    assert "default: train.sliding_window" in message
    assert "variants.norms: train.norm_before_fc" in message and "variants.norms: train.sliding_window" in message
    assert "variants.k2: train.norm_before_fc" not in message


def test_merged_overrides_key_by_key():
    assert merged({"a": {"b": 1, "c": 2}, "d": 3}, {"a": {"c": 5}}) == {"a": {"b": 1, "c": 5}, "d": 3}
