"""EAGLE-3's MLA draft layer (`train.draft_attention: mla`, train/methods/eagle3.py):
multi-head latent attention as the verifier has it, with a dense MLP: the layer of vLLM's
Eagle3DeepseekV2ForCausalLM, trained in speculators' Eagle3DraftModel with a DeepSeek-V3 layer
(registered below) and exported in the plain config + weights format vLLM loads it from
(speculators' format names Llama- and Qwen3-shaped layers only)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# vLLM's MLA EAGLE-3 draft: the architecture an MLA draft's config.json names.
MLA_ARCHITECTURE = "Eagle3DeepseekV2ForCausalLM"
# Beside an MLA draft's vLLM config: the speculators config the same weights reload with here.
SPECULATORS_SIDECAR = "eagleflow_speculators_config.json"


def mla_layer_config(v: dict[str, Any], num_layers: int, attn_impl: str):
    """A DeepSeek-V3 layer config with the verifier's MLA geometry (heads, q/kv LoRA ranks,
    nope/rope/v head dims) and a dense MLP in every layer, as vLLM's EAGLE-3 MLA draft has.
    Plain rope at the verifier's theta, as for the Llama-shaped draft. Pure."""
    from transformers import DeepseekV3Config

    from eagleflow.common.verifier_config import is_mla
    from eagleflow.train.draft import draft_rope_parameters

    if not is_mla(v):
        raise ValueError(
            f"train.draft_attention: mla needs a verifier with multi-head latent attention (kv_lora_rank in its "
            f"config.json); this one ({v.get('model_type')}) has none: use draft_attention: llama"
        )
    config = DeepseekV3Config(
        vocab_size=v["vocab_size"],
        hidden_size=v["hidden_size"],
        intermediate_size=v["intermediate_size"],
        num_hidden_layers=num_layers,
        num_attention_heads=v["num_attention_heads"],
        num_key_value_heads=v["num_attention_heads"],
        q_lora_rank=v.get("q_lora_rank"),
        kv_lora_rank=v["kv_lora_rank"],
        qk_nope_head_dim=v["qk_nope_head_dim"],
        qk_rope_head_dim=v["qk_rope_head_dim"],
        v_head_dim=v["v_head_dim"],
        first_k_dense_replace=num_layers,  # no MoE layer
        hidden_act="silu",
        max_position_embeddings=v.get("max_position_embeddings", 4096),
        rms_norm_eps=v.get("rms_norm_eps", 1e-6),
        rope_parameters=draft_rope_parameters(v),
        rope_interleave=True,  # vLLM's MLA rotates interleaved pairs (is_neox_style=False)
        tie_word_embeddings=False,
    )
    config._attn_implementation = attn_impl
    return config


def register_mla_draft_layer() -> None:
    """Teach speculators' Eagle3DraftModel a DeepSeek-V3 (MLA) layer: its first layer's
    down-projections read cat(embeds, hidden) (2 x hidden_size wide), as the first layer of
    vLLM's Eagle3DeepseekV2ForCausalLM does; the EAGLE-3 norms and residual are speculators'
    own (Eagle3FirstLayerMixin). Idempotent."""
    from speculators.models.base_components import ModelComponents
    from speculators.models.eagle3.model_definitions import Eagle3FirstLayerMixin, model_classes
    from torch import nn
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3DecoderLayer,
        DeepseekV3RMSNorm,
        DeepseekV3RotaryEmbedding,
    )

    if "deepseek_v3" in model_classes:
        return

    class DeepseekV3DecoderEagle3FirstLayer(Eagle3FirstLayerMixin, DeepseekV3DecoderLayer):
        def __init__(self, config, layer_idx: int, norm_before_residual: bool = False):
            super().__init__(config, layer_idx)
            self.norm_before_residual = norm_before_residual
            self.hidden_norm = DeepseekV3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            attn, wide = self.self_attn, 2 * config.hidden_size
            if config.q_lora_rank is None:
                attn.q_proj = nn.Linear(wide, attn.num_heads * attn.qk_head_dim, bias=False)
            else:
                attn.q_a_proj = nn.Linear(wide, config.q_lora_rank, bias=config.attention_bias)
            attn.kv_a_proj_with_mqa = nn.Linear(
                wide, config.kv_lora_rank + config.qk_rope_head_dim, bias=config.attention_bias
            )

    model_classes["deepseek_v3"] = ModelComponents(
        DeepseekV3DecoderEagle3FirstLayer, DeepseekV3DecoderLayer, DeepseekV3RMSNorm, DeepseekV3RotaryEmbedding
    )


def is_mla_draft(model) -> bool:
    return model.config.transformer_layer_config.model_type == "deepseek_v3"


def mla_draft_config(model) -> dict[str, Any]:
    """config.json of an MLA draft as vLLM reads it: the DeepSeek layer config, the
    architecture of vLLM's MLA EAGLE-3 draft, and the EAGLE-3 fields
    (draft vocabulary, aux layer ids, the residual's norm). Pure."""
    layer = model.config.transformer_layer_config.to_dict()
    ids = list(model.config.eagle_aux_hidden_state_layer_ids)
    drop = {"_attn_implementation_autoset", "transformers_version", "dtype", "torch_dtype", "auto_map"}
    return {
        **{k: v for k, v in layer.items() if k not in drop},
        "architectures": [MLA_ARCHITECTURE],
        # Not deepseek_v3: vLLM turns a deepseek_v3 draft config into its MTP model
        # (SpeculativeConfig.hf_config_override). The layer is the same.
        "model_type": "deepseek_v2",
        "dtype": "bfloat16",
        "draft_vocab_size": int(model.config.draft_vocab_size),
        "target_hidden_size": int(layer["hidden_size"]),
        "norm_before_residual": bool(model.config.norm_before_residual),
        "norm_output": bool(model.config.norm_output),
        "eagle_aux_hidden_state_layer_ids": ids,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids},
    }


def mla_exported(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What an MLA draft's model.safetensors holds: every tensor but the frozen verifier_*
    ones, as in speculators' checkpoints."""
    return {k: v for k, v in state_dict.items() if not k.startswith("verifier_")}


def export_mla_draft(model, weights: dict[str, torch.Tensor], out_dir: Path) -> None:
    """vLLM's Eagle3DeepseekV2ForCausalLM reads `layers.0.self_attn.q_a_proj` and
    `kv_a_proj_with_mqa` (it fuses them), `fc`, `norm`, `lm_head`, `d2t`, `embed_tokens` by
    these names and skips `t2d` (mla_exported).
    The speculators config goes beside it (SPECULATORS_SIDECAR) for reload_mla_draft."""
    from safetensors.torch import save_file

    from eagleflow.common.atomic import write_json

    out_dir.mkdir(parents=True, exist_ok=True)
    kept = {k: v.contiguous() for k, v in mla_exported(weights).items()}
    save_file(kept, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    write_json(out_dir / "config.json", mla_draft_config(model))
    write_json(out_dir / SPECULATORS_SIDECAR, model.config.to_dict())


def reload_mla_draft(method, draft_dir: str, attn_impl: str | None):
    """An MLA draft exported by export_mla_draft, as `method`'s speculators model, from the
    speculators config beside vLLM's and the weights; the verifier's tensors it leaves out are
    train.draft.load_draft's."""
    import json

    from safetensors.torch import load_file

    from eagleflow.train.methods.base import reloaded_config

    register_mla_draft_layer()
    raw = json.loads((Path(draft_dir) / SPECULATORS_SIDECAR).read_text())
    model = method.model_class(config=reloaded_config(method.config_class.from_dict(raw), draft_dir, attn_impl))
    missing, unexpected = model.load_state_dict(load_file(str(Path(draft_dir) / "model.safetensors")), strict=False)
    missing = [k for k in missing if not k.startswith("verifier_")]
    if missing or unexpected:
        raise ValueError(f"{draft_dir}: weights do not fit the draft: missing {missing}, unexpected {unexpected}")
    return model
