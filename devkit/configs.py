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


def extraction_section(hidden_states: dict) -> dict:
    """The hidden_states section as the extraction and parity jobs receive it (workflow/rules:
    section_without): without `served`, served mode's transfer, which the train job reads
    (train.served_servers.ServedSettings), and each key under the stage's name for it."""
    from eagleflow.dag.rule_params import section_param

    return section_param({"hidden_states": hidden_states}, "hidden_states", ("served",))


def hidden_states_config(**overrides):
    from eagleflow.common.config import typed
    from eagleflow.hidden_states.backend import HiddenStatesConfig

    return typed(HiddenStatesConfig, extraction_section(config_section("hidden_states", **overrides)), "hidden_states")


def train_config(**overrides):
    from eagleflow.common.config import typed
    from eagleflow.train.config import TrainConfig

    return typed(TrainConfig, config_section("train", **overrides), "train")


def build_draft(
    verifier_dir,
    d2t,
    t2d,
    *,
    num_layers: int,
    ttt_steps: int,
    aux_layer_ids: list[int],
    attn_impl: str,
    sliding_window=None,
    attention: str = "llama",
    norm_before_fc: bool = False,
    norm_output: bool = False,
):
    """A fresh EAGLE-3 draft of these settings (the rest: train_config's) with the verifier's
    embeddings and lm_head rows loaded, as the train stage builds it (DraftMethod.build)."""
    from eagleflow.train.methods import DraftSpec, draft_method

    cfg = train_config(
        method="eagle3",
        num_layers=num_layers,
        ttt_steps=ttt_steps,
        sliding_window=sliding_window,
        draft_attention=attention,
        norm_before_fc=norm_before_fc,
        norm_output=norm_output,
    )
    return draft_method(cfg.method).build(DraftSpec(str(verifier_dir), d2t, t2d, list(aux_layer_ids), attn_impl), cfg)
