import copy

import pytest
import yaml

from eagleflow.common.config import ConfigError, load_config, validate_config
from eagleflow.dag.variants import validate_variants
from tests.helpers import REPO


@pytest.fixture
def default():
    return yaml.safe_load((REPO / "config/config.yaml").read_text())


def test_default_config_is_valid(default):
    validate_config(default)


@pytest.mark.parametrize(
    "example",
    [p for p in sorted((REPO / "config").rglob("*.yaml")) if p.name != "schema.yaml"],
    ids=lambda p: str(p.relative_to(REPO / "config")),
)
def test_shipped_configs_are_valid_once_merged(example, default):
    merged = merge(default, yaml.safe_load(example.read_text()))
    validate_config(merged)
    validate_variants(merged)


def merge(base, override):
    out = copy.deepcopy(base)
    for k, v in override.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def test_misspelled_key_is_named(default):
    default["generate"]["concurrancy"] = 8
    with pytest.raises(ConfigError) as exc:
        validate_config(default)
    msg = str(exc.value)
    assert "generate.concurrancy" in msg
    assert "concurrency" in msg  # the allowed keys are listed


def test_wrong_type_names_key_and_value(default):
    default["train"]["lr"] = "fast"
    with pytest.raises(ConfigError, match=r"train\.lr: expected type number, got 'fast'"):
        validate_config(default)


def test_every_problem_is_reported(default):
    default["train"]["epochs"] = 0
    default["vocab"]["draft_vocab_size"] = -1
    del default["run"]
    with pytest.raises(ConfigError) as exc:
        validate_config(default)
    msg = str(exc.value)
    assert "3 problems" in msg
    assert "train.epochs: expected >= 1, got 0" in msg
    assert "vocab.draft_vocab_size" in msg
    assert "'run' is a required property" in msg


def test_path_source_needs_a_path(default):
    default["verifier"]["source"] = "path"
    with pytest.raises(ConfigError, match="verifier.path"):
        validate_config(default)


def test_load_config_reads_yaml(tmp_path, default):
    default["server"]["dtype"] = "float64"
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(default))
    with pytest.raises(ConfigError, match=r"server\.dtype: expected one of"):
        load_config(path)


def test_concurrency_is_a_ceiling_or_auto(default):
    default["generate"]["concurrency"] = "auto"
    default["hidden_states"]["vllm"]["concurrency"] = 12
    validate_config(default)
    default["generate"]["concurrency"] = "lots"
    with pytest.raises(ConfigError, match=r"generate\.concurrency"):
        validate_config(default)


def test_a_config_from_before_the_generate_section_is_told_where_each_setting_went(default):
    """The request settings moved from `synth` to `generate`: an older config (or one merged
    over the default) names each one and its new place, instead of a schema error."""
    default["synth"] |= {"max_tokens": 40, "concurrency": 8}
    with pytest.raises(ConfigError) as exc:
        validate_config(default)
    msg = str(exc.value)
    assert "synth.max_tokens: moved to generate.max_tokens" in msg
    assert "synth.concurrency: moved to generate.concurrency" in msg
    assert "expect_reasoning" not in msg  # what stays in synth is not named
