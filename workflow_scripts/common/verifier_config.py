"""The verifier's language-model config, read as JSON (no remote code runs)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of a config dict: multimodal verifiers such as Kimi-K2.5
    nest it under `text_config`."""
    return config.get("text_config") or config


def read_text_config(model_dir: str | os.PathLike) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    try:
        return text_config(json.loads(path.read_text()))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read the verifier's config ({exc})") from exc


def is_mla(v: dict[str, Any]) -> bool:
    """Multi-head latent attention (DeepSeek-V3, Kimi-K2): keys and values come from a
    compressed latent, so there is no plain head_dim / num_key_value_heads to copy."""
    return v.get("kv_lora_rank") is not None


def draft_attention_geometry(v: dict[str, Any]) -> tuple[int, int, int]:
    """(num_attention_heads, num_key_value_heads, head_dim) of the draft's Llama layer. Pure.

    MLA verifiers: the draft keeps the verifier's query heads and uses head_dim =
    v_head_dim (128 on DeepSeek-V3 and Kimi-K2: the size each head contributes to the
    output projection, and a size every attention kernel supports; qk_nope + qk_rope = 192
    is not), with one KV head per query head as MLA behaves at inference.
    """
    heads = int(v["num_attention_heads"])
    if is_mla(v):
        head_dim = int(v.get("v_head_dim") or v["qk_nope_head_dim"])
        return heads, heads, head_dim
    kv_heads = int(v.get("num_key_value_heads") or heads)
    head_dim = int(v.get("head_dim") or v["hidden_size"] // heads)
    return heads, kv_heads, head_dim
