"""The verifier's tensors the draft shares or needs (embeddings, lm_head, final norm), read by
name from its safetensors: no model code runs, so custom-code verifiers read like Llama."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open

from eagleflow.common.verifier_config import read_text_config, safetensors_weight_map

# Where checkpoints keep the two tensors the draft shares with its verifier, by name.
# Multimodal wrappers (Kimi-K2.5) prefix the language model's weights.
EMBED_NAMES = (
    "model.embed_tokens.weight",
    "language_model.model.embed_tokens.weight",
    "model.language_model.embed_tokens.weight",
    "transformer.wte.weight",
)
LM_HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight", "model.language_model.lm_head.weight")
FINAL_NORM_NAMES = ("model.norm.weight", "language_model.model.norm.weight", "model.language_model.norm.weight")


def load_verifier_embeddings(verifier_dir: str | os.PathLike) -> tuple[torch.Tensor, torch.Tensor]:
    """(embed_tokens, lm_head) weights of the verifier, read by name from its safetensors.

    speculators' `load_verifier_weights` resolves the verifier through AutoConfig without
    trust_remote_code, so custom-code verifiers fail there. Tied embeddings (no lm_head
    tensor; SmolLM2) reuse embed_tokens as lm_head.
    """
    weights = safetensors_weight_map(verifier_dir)
    embed = _read_embeddings(verifier_dir, weights)
    lm_head = _read_first(weights, LM_HEAD_NAMES)
    if lm_head is None:
        _check_tied(verifier_dir)
        lm_head = embed
    return embed, lm_head


def load_verifier_lm_head(verifier_dir: str | os.PathLike) -> torch.Tensor:
    """The verifier's lm_head weight alone (a tied checkpoint's embeddings), without reading
    an untied checkpoint's embeddings (2.3 GB for Kimi-K2.5)."""
    weights = safetensors_weight_map(verifier_dir)
    lm_head = _read_first(weights, LM_HEAD_NAMES)
    if lm_head is None:
        _check_tied(verifier_dir)
        lm_head = _read_embeddings(verifier_dir, weights)
    return lm_head


def _read_embeddings(verifier_dir: str | os.PathLike, weights: dict[str, Path]) -> torch.Tensor:
    embed = _read_first(weights, EMBED_NAMES)
    if embed is None:
        raise KeyError(f"{verifier_dir}: no embedding tensor among {EMBED_NAMES}")
    return embed


def _check_tied(verifier_dir: str | os.PathLike) -> None:
    """A checkpoint without an lm_head tensor must say its embeddings are tied."""
    top = json.loads((Path(verifier_dir) / "config.json").read_text())
    if not (top.get("tie_word_embeddings") or read_text_config(verifier_dir).get("tie_word_embeddings")):
        raise KeyError(f"{verifier_dir}: no lm_head tensor among {LM_HEAD_NAMES} and tie_word_embeddings is false")


def _read_first(weights: dict[str, Path], names: tuple[str, ...]) -> torch.Tensor | None:
    for name in names:
        if name in weights:
            with safe_open(str(weights[name]), framework="pt") as f:
                return f.get_tensor(name)
    return None


def load_verifier_final_norm(verifier_dir: str | os.PathLike) -> torch.Tensor:
    """The weight of the verifier's final norm. The trainer recomputes the verifier's logits
    as lm_head(norm(final pre-norm state)): without this weight the draft learns to match
    logits the verifier never produces."""
    norm = _read_first(safetensors_weight_map(verifier_dir), FINAL_NORM_NAMES)
    if norm is None:
        raise KeyError(f"{verifier_dir}: no final norm tensor among {FINAL_NORM_NAMES}")
    return norm
