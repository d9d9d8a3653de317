"""The config sections as every run has them: config/config.yaml, with overrides merged over it."""

from __future__ import annotations

from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def config_section(name: str, **overrides) -> dict:
    """Section `name` of config/config.yaml (every key, as every run has it: a run's config is
    merged over that file), with `overrides` merged over it."""
    return merged(yaml.safe_load((REPO / "config/config.yaml").read_text())[name], overrides)


def merged(base: dict, override: dict) -> dict:
    out = dict(base)
    for k, v in override.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def server_config(**overrides):
    from eagleflow.runtime.spec import ServerConfig

    return ServerConfig.from_section(config_section("server", **overrides))


def lean_server_config(**overrides):
    """The server section of the test DAG (tests/config/small.yaml): the vLLM that starts in
    about 21 s instead of 36 on this machine (no worker process, a 1 GiB KV cache)."""
    lean = yaml.safe_load((REPO / "tests/config/small.yaml").read_text())["server"]
    return server_config(**merged(lean, overrides))


def hidden_states_config(**overrides):
    from eagleflow.common.config import typed
    from eagleflow.hidden_states.backend import HiddenStatesConfig

    # As the extraction jobs take it (workflow/rules: section_without): served mode's
    # transfer is the train job's (train.served.ServedSettings).
    section = {k: v for k, v in config_section("hidden_states", **overrides).items() if k != "served"}
    return typed(HiddenStatesConfig, section, "hidden_states")


def train_config(**overrides):
    from eagleflow.common.config import typed
    from eagleflow.train.config import TrainConfig

    return typed(TrainConfig, config_section("train", **overrides), "train")
