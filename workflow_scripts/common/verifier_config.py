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


# Model types vLLM serves with its DeepseekV2 model code (vllm/model_executor/models/deepseek_v2.py).
DEEPSEEK_MODEL_TYPES = frozenset({"deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2"})


def served_as_deepseek(v: dict[str, Any]) -> bool:
    """Whether vLLM serves this config with its DeepseekV2 code: by architecture (Kimi-K2's
    custom code names DeepseekV3ForCausalLM) or model type."""
    archs = v.get("architectures") or []
    return v.get("model_type") in DEEPSEEK_MODEL_TYPES or any(a.startswith("Deepseek") for a in archs)


def checkpoint_tensor_names(model_dir: str | os.PathLike) -> set[str]:
    """Tensor names of a safetensors checkpoint, from its index or the files' headers (no
    tensor is read)."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    from safetensors import safe_open

    names: set[str] = set()
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            names.update(f.keys())
    return names


def vllm_serving_problems(v: dict[str, Any], dtype: str, tensor_names: set[str]) -> list[str]:
    """What stops vLLM from serving this verifier, known from its config and tensor names
    before a launch (each would otherwise surface minutes later as an error naming neither
    the setting nor the fix). Pure."""
    problems = []
    if is_mla(v) and dtype == "float32":
        problems.append(
            "an MLA verifier (kv_lora_rank is set) with server.dtype float32: vLLM's MLA attention "
            "takes bfloat16 or float16 weights only (on CPU too); set server.dtype: bfloat16"
        )
    biased = any(name.endswith("e_score_correction_bias") for name in tensor_names)
    if v.get("n_routed_experts") and biased and v.get("topk_method") != "noaux_tc":
        problems.append(
            f"the checkpoint routes its experts with e_score_correction_bias but config.json says "
            f"topk_method: {v.get('topk_method')!r}: vLLM's DeepseekV2 loads that bias only with "
            "topk_method: noaux_tc (DeepSeek-V3 and Kimi-K2 routing) and stops with a KeyError; "
            "set it in config.json"
        )
    return problems


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
