"""The EAGLE-3 layer convention (see docs/data-contracts.md) and the verifier geometry it
needs: which layers are captured, and what vLLM calls them. Pure; config.json is the only
file read."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from eagleflow.common.verifier_config import read_text_config, served_as_deepseek

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
CONVENTION = (
    "aux i = input of decoder layer i (vLLM/speculators); "
    "final = last layer output before the final norm (vLLM layer id L)"
)

# (aux states [tokens, n_aux * hidden], final pre-norm state [tokens, hidden]) per sample
States = tuple["torch.Tensor", "torch.Tensor"]


@dataclass(frozen=True)
class VerifierGeometry:
    num_layers: int
    hidden_size: int
    # vLLM serves it with its DeepseekV2 model code (DeepSeek-V2/V3, Kimi-K2), whose forward
    # cannot return the input of layer 0 as an aux state.
    deepseek: bool = False


def verifier_geometry(verifier_dir: str) -> VerifierGeometry:
    """Layers and hidden size from config.json alone: no model code, no weights (the disk
    check runs before a 1T-parameter verifier is loaded)."""
    config = read_text_config(verifier_dir)
    try:
        return VerifierGeometry(
            int(config["num_hidden_layers"]), int(config["hidden_size"]), served_as_deepseek(config)
        )
    except (KeyError, ValueError) as exc:
        raise ValueError(
            f"{Path(verifier_dir) / 'config.json'}: cannot read num_hidden_layers and hidden_size ({exc})"
        ) from exc


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """vLLM's and speculators' default, (2, L//2, L-3), from 8 layers up. Below that those
    collide (L=6: 2, 3, 3), and the input of layer 0 (the embeddings) is no choice either:
    vLLM's DeepseekV2 forward adds a None residual there and crashes. Small verifiers (test
    and distilled models) get the first, middle and last of layers 1..L-1. Pure."""
    if num_layers >= 8:
        return [2, num_layers // 2, num_layers - 3]
    if num_layers < 2:
        raise ValueError(f"a verifier of {num_layers} layer(s) has no layer to capture besides the embeddings")
    layers = list(range(1, num_layers))
    return sorted({layers[0], layers[len(layers) // 2], layers[-1]})


def resolve_aux_layer_ids(configured: list[int] | None, geometry: VerifierGeometry) -> list[int]:
    """The configured ids (default: `default_aux_layer_ids`), checked against what vLLM can
    serve for this verifier. Pure."""
    num_layers = geometry.num_layers
    ids = list(configured) if configured else default_aux_layer_ids(num_layers)
    # Ascending because vLLM emits aux states in layer order whatever order they are listed in.
    if ids != sorted(set(ids)) or min(ids) < 0 or max(ids) >= num_layers:
        raise ValueError(
            f"hidden_states.aux_layer_ids {ids} must be strictly ascending layer indices in 0..{num_layers - 1}"
        )
    if geometry.deepseek and ids[0] == 0:
        raise ValueError(
            f"hidden_states.aux_layer_ids {ids}: vLLM serves this verifier with its DeepseekV2 code, whose "
            "forward cannot emit the input of layer 0 (the embeddings: it adds a residual that does not exist "
            "yet and the EAGLE-3 benchmark crashes); start at layer 1"
        )
    return ids


def vllm_layer_ids(aux_layer_ids: list[int], num_layers: int) -> list[int]:
    return [*aux_layer_ids, num_layers]
