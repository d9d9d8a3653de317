"""Build, export and reload an EAGLE-3 draft.

The draft's decoder layer copies the verifier's attention geometry (hidden size, heads,
head_dim, rope) so that vLLM's EAGLE-3 implementation can serve it next to the verifier.
Everything is read from the verifier's config.json and safetensors by name, never by
running its model code: custom-code verifiers (Kimi-K2's `kimi_k2`, loaded with
trust_remote_code) build drafts the same way as Llama.

Two draft layers (`train.draft_attention`):
- `llama`: a Llama decoder layer (speculators' Eagle3DraftModel), exported in the
  speculators checkpoint format; for MLA verifiers with one KV head per query head.
- `mla`: multi-head latent attention as the verifier has it, with a dense MLP: the layer of
  vLLM's Eagle3DeepseekV2ForCausalLM, trained here in speculators' Eagle3DraftModel with a
  DeepSeek-V3 layer (registered below) and exported in the plain config + weights format
  vLLM loads it from (speculators' format names Llama- and Qwen3-shaped layers only).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig

from eagleflow.common.verifier_config import draft_attention_geometry, is_mla, read_text_config
from eagleflow.common.verifier_weights import load_verifier_embeddings, load_verifier_final_norm
from eagleflow.train.attention import register as register_attention
from eagleflow.train.config import unservable_settings

log = logging.getLogger(__name__)


def draft_rope_parameters(v: dict[str, Any]) -> dict[str, Any]:
    """Rope for the draft layer. Pure.

    transformers 5 writes `rope_parameters`; older configs `rope_theta` + `rope_scaling`.
    MLA verifiers rotate only qk_rope_head_dim dims with DeepSeek's yarn variant, which a
    Llama layer cannot reproduce: the draft uses plain rope at the verifier's theta.
    """
    theta = float((v.get("rope_parameters") or {}).get("rope_theta") or v.get("rope_theta") or 10000.0)
    if is_mla(v):
        return {"rope_type": "default", "rope_theta": theta}
    if v.get("rope_parameters"):
        return dict(v["rope_parameters"])
    scaling = v.get("rope_scaling") or {}
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    return {**{k: val for k, val in scaling.items() if k != "type"}, "rope_type": rope_type, "rope_theta": theta}


DRAFT_ATTENTIONS = ("llama", "mla")


def draft_layer_config(
    verifier_dir: str,
    num_layers: int,
    attn_impl: str,
    sliding_window: int | None = None,
    attention: str = "llama",
    config_class=LlamaConfig,
):
    """The draft decoder's config. `sliding_window` None: full attention in every draft layer;
    an int: that window in every layer (speculators' own trainer defaults to 2048; vLLM's MLA
    draft layer has none, and build_draft refuses one there). `config_class`: the layer's
    transformers config, Llama's (EAGLE-3, P-EAGLE) or Qwen3's (DFlash, train/methods.py), with
    the verifier's attention geometry either way."""
    v = read_text_config(verifier_dir)
    if attention == "mla":
        return mla_layer_config(v, num_layers, attn_impl)
    if attention != "llama":
        raise ValueError(f"train.draft_attention must be one of {DRAFT_ATTENTIONS}, not {attention!r}")
    heads, kv_heads, head_dim = draft_attention_geometry(v)
    config = config_class(
        vocab_size=v["vocab_size"],
        hidden_size=v["hidden_size"],
        intermediate_size=v["intermediate_size"],
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        hidden_act="silu",
        max_position_embeddings=v.get("max_position_embeddings", 4096),
        rms_norm_eps=v.get("rms_norm_eps", 1e-6),
        rope_parameters=draft_rope_parameters(v),
        tie_word_embeddings=False,
        sliding_window=sliding_window,
        use_sliding_window=sliding_window is not None,
        layer_types=["sliding_attention" if sliding_window is not None else "full_attention"] * num_layers,
    )
    config._attn_implementation = attn_impl
    return config


def mla_layer_config(v: dict[str, Any], num_layers: int, attn_impl: str):
    """A DeepSeek-V3 layer config with the verifier's MLA geometry (heads, q/kv LoRA ranks,
    nope/rope/v head dims) and a dense MLP in every layer, as vLLM's EAGLE-3 MLA draft has.
    Plain rope at the verifier's theta, as for the Llama-shaped draft. Pure."""
    from transformers import DeepseekV3Config

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


def load_verifier_weights(model, verifier_dir: str, t2d: torch.Tensor) -> None:
    """What speculators' Eagle3DraftModel.load_verifier_weights does, without model code:
    embeddings as they are, lm_head rows of the draft vocabulary (t2d) and the final norm
    (verifier_norm), all frozen."""
    embed, lm_head = load_verifier_embeddings(verifier_dir)
    if embed.shape != model.embed_tokens.weight.shape:
        raise ValueError(
            f"{verifier_dir}: embeddings {tuple(embed.shape)}, the "
            f"draft expects {tuple(model.embed_tokens.weight.shape)}"
        )
    draft_head = lm_head[t2d.to(torch.bool)] if model.use_draft_vocab else lm_head
    dtype = model.embed_tokens.weight.dtype
    with torch.no_grad():
        model.embed_tokens.weight.copy_(embed.to(dtype))
        model.lm_head.weight.copy_(draft_head.to(dtype))
        model.verifier_lm_head.weight.copy_(draft_head.to(dtype))
        model.verifier_norm.weight.copy_(load_verifier_final_norm(verifier_dir).to(dtype))
    freeze_verifier_parts(model)
    # EAGLE-3 freezes its embeddings by default, P-EAGLE trains them; DFlash has no such setting.
    model.embed_tokens.weight.requires_grad_(getattr(model.config, "embed_requires_grad", False))


def freeze_verifier_parts(model) -> None:
    """The verifier's own tensors in the draft (embeddings, head, final norm) take no gradient."""
    for p in (
        model.embed_tokens.weight,
        model.lm_head.weight,
        model.verifier_lm_head.weight,
        model.verifier_norm.weight,
    ):
        p.requires_grad_(False)


def take_precomputed_targets(model) -> None:
    """Training on shards with the compact target (hidden_states.target: topk): the batch
    brings the verifier's logits on the draft vocabulary themselves, in the place of the final
    state, so the forward's verifier_lm_head(verifier_norm(.)) must pass them through. Neither
    module is part of the exported draft."""
    from torch import nn

    model.verifier_norm = nn.Identity()
    model.verifier_lm_head = nn.Identity()


def build_draft(
    verifier_dir: str,
    d2t: torch.Tensor,
    t2d: torch.Tensor,
    *,
    num_layers: int,
    ttt_steps: int,
    aux_layer_ids: list[int],
    attn_impl: str,
    norm_before_residual: bool = True,
    sliding_window: int | None = None,
    attention: str = "llama",
    norm_before_fc: bool = False,
    norm_output: bool = False,
    algorithm: str = "eagle3",
    config_class=None,
    model_class=None,
    extra: dict[str, Any] | None = None,
):
    """A freshly initialised draft with the verifier's embeddings and lm_head rows loaded.

    `aux_layer_ids` become the config's eagle_aux_hidden_state_layer_ids: vLLM serving
    the draft captures the same layers the draft was trained on. EAGLE-3 by default; a method
    built on its layer (P-EAGLE, train/methods.py) passes its `algorithm`, speculators'
    config and model classes and its own config fields (`extra`)."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    config_class = config_class or Eagle3SpeculatorConfig
    model_class = model_class or Eagle3DraftModel

    # The layer built here is EAGLE-3's, whichever method builds on it (P-EAGLE).
    settings = {
        "method": "eagle3",
        "draft_attention": attention,
        "sliding_window": sliding_window,
        "norm_before_fc": norm_before_fc,
    }
    if problems := unservable_settings(settings):
        raise ValueError("; ".join(problems))
    register_mla_draft_layer()
    register_attention()
    layer_config = draft_layer_config(
        verifier_dir, num_layers, attn_impl, sliding_window=sliding_window, attention=attention
    )
    config = config_class(
        transformer_layer_config=layer_config,
        draft_vocab_size=int(d2t.shape[0]),
        norm_before_residual=norm_before_residual,
        norm_before_fc=norm_before_fc,
        norm_output=norm_output,
        eagle_aux_hidden_state_layer_ids=list(aux_layer_ids),
        **(extra or {}),
        speculators_config=SpeculatorsConfig(
            algorithm=algorithm,
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=ttt_steps)],
            default_proposal_method="greedy",
            verifier=VerifierConfig.from_pretrained(verifier_dir),
        ),
    )
    model = model_class(config=config)
    model.load_vocab_mappings(t2d, d2t)
    load_verifier_weights(model, verifier_dir, t2d)
    return model


# Beside an MLA draft's vLLM config: the speculators config the same weights reload with here.
SPECULATORS_SIDECAR = "eagleflow_speculators_config.json"


def is_mla_draft(model) -> bool:
    return model.config.transformer_layer_config.model_type == "deepseek_v3"


def export_draft(model, state_dict: dict[str, torch.Tensor], out_dir: Path, serve_verifier_path: str) -> None:
    """Save `state_dict` in `model`'s architecture in `out_dir`, as vLLM loads it: a
    speculators checkpoint for the Llama-shaped draft, vLLM's own EAGLE-3 format for the MLA
    draft (`export_mla_draft`).

    The checkpoint names the verifier path that will *serve* it, which on a cluster is
    usually not the path the draft was trained from.
    """
    model.config.speculators_config.verifier.name_or_path = serve_verifier_path
    weights = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state_dict.items()}
    if is_mla_draft(model):
        export_mla_draft(model, weights, Path(out_dir))
    else:
        model.save_pretrained(out_dir, state_dict=weights)


def mla_draft_config(model) -> dict[str, Any]:
    """config.json of an MLA draft as vLLM reads it: the DeepSeek layer config, the
    architecture of vLLM's MLA EAGLE-3 draft, and the EAGLE-3 fields
    (draft vocabulary, aux layer ids, the residual's norm). Pure."""
    layer = model.config.transformer_layer_config.to_dict()
    ids = list(model.config.eagle_aux_hidden_state_layer_ids)
    drop = {"_attn_implementation_autoset", "transformers_version", "dtype", "torch_dtype", "auto_map"}
    return {
        **{k: v for k, v in layer.items() if k not in drop},
        "architectures": ["Eagle3DeepseekV2ForCausalLM"],
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


def export_mla_draft(model, weights: dict[str, torch.Tensor], out_dir: Path) -> None:
    """vLLM's Eagle3DeepseekV2ForCausalLM reads `layers.0.self_attn.q_a_proj` and
    `kv_a_proj_with_mqa` (it fuses them), `fc`, `norm`, `lm_head`, `d2t`, `embed_tokens` by
    these names and skips `t2d`; the frozen verifier_* tensors stay out, as in speculators'
    checkpoints.
    The speculators config goes beside it (SPECULATORS_SIDECAR) for load_draft."""
    from safetensors.torch import save_file

    from eagleflow.common.atomic import write_json

    out_dir.mkdir(parents=True, exist_ok=True)
    kept = {k: v.contiguous() for k, v in weights.items() if not k.startswith("verifier_")}
    save_file(kept, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    write_json(out_dir / "config.json", mla_draft_config(model))
    write_json(out_dir / SPECULATORS_SIDECAR, model.config.to_dict())


def load_draft(draft_dir: str, verifier_dir: str | None = None, attn_impl: str | None = None):
    """Reload an exported draft as the speculators model of its method, for any verifier.

    speculators' from_pretrained ends in Eagle3DraftModel.load_verifier_weights, which
    reads the verifier's config through AutoConfig without trust_remote_code (custom-code
    verifiers such as kimi_k2 fail), and resolves default layer ids the same way. Here the
    config and weights load through transformers' PreTrainedModel path, layer ids must be
    explicit (eagleflow always writes them), and the frozen verifier_lm_head (not saved in
    the checkpoint) and verifier_norm are read from `verifier_dir` (default: the path the checkpoint names)
    by tensor name. `attn_impl` overrides the attention the checkpoint was trained with (its
    default, flex attention, has no CPU backend). In float32, as it trained: the checkpoint
    stores bfloat16 for vLLM, and a CPU computes in float32 only.
    """
    from speculators import SpeculatorModel, SpeculatorModelConfig
    from transformers import PreTrainedModel

    register_mla_draft_layer()
    register_attention()
    sidecar = Path(draft_dir) / SPECULATORS_SIDECAR
    # An MLA draft: vLLM's config.json, speculators' beside it. Otherwise speculators' format,
    # whose speculators_model_type names the method (train/methods.py).
    raw = json.loads((sidecar if sidecar.is_file() else Path(draft_dir) / "config.json").read_text())
    method = raw.get("speculators_model_type", "eagle3")
    if method not in SpeculatorModel.registry:
        raise ValueError(f"{draft_dir}/config.json: speculators_model_type {method!r} is no draft speculators knows")
    config_class, model_class = SpeculatorModelConfig.registry[method], SpeculatorModel.registry[method]
    config = config_class.from_dict(raw) if sidecar.is_file() else config_class.from_pretrained(draft_dir)
    if attn_impl is not None:
        config.transformer_layer_config._attn_implementation = attn_impl
    if not draft_aux_layer_ids(config):
        raise ValueError(f"{draft_dir}/config.json has no aux hidden state layer ids")
    if sidecar.is_file():
        from safetensors.torch import load_file

        model = model_class(config=config)
        missing, unexpected = model.load_state_dict(load_file(str(Path(draft_dir) / "model.safetensors")), strict=False)
        missing = [k for k in missing if not k.startswith("verifier_")]
        if missing or unexpected:
            raise ValueError(f"{draft_dir}: weights do not fit the draft: missing {missing}, unexpected {unexpected}")
    else:
        model = PreTrainedModel.from_pretrained.__func__(model_class, draft_dir, config=config)
    verifier_dir = verifier_dir or config.speculators_config.verifier.name_or_path
    if not verifier_dir or not Path(verifier_dir).is_dir():
        raise FileNotFoundError(f"{draft_dir}: verifier {verifier_dir!r} is not a local directory; pass verifier_dir")
    embed, lm_head = load_verifier_embeddings(verifier_dir)
    rows = lm_head[model.t2d.to(torch.bool)] if model.use_draft_vocab else lm_head
    with torch.no_grad():
        # What a method's checkpoint leaves out is the verifier's own (DFlash: the embeddings,
        # and the head where the draft predicts the whole vocabulary).
        unsaved = getattr(model, "_keys_to_ignore_on_save", None) or []
        if "embed_tokens.weight" in unsaved:
            model.embed_tokens.weight.copy_(embed.to(model.embed_tokens.weight.dtype))
        if "lm_head.weight" in unsaved:
            model.lm_head.weight.copy_(rows.to(model.lm_head.weight.dtype))
        model.verifier_lm_head.weight.copy_(rows.to(model.verifier_lm_head.weight.dtype))
        model.verifier_norm.weight.copy_(load_verifier_final_norm(verifier_dir).to(model.verifier_norm.weight.dtype))
    freeze_verifier_parts(model)
    return model.float()


def draft_aux_layer_ids(config) -> list[int]:
    """The aux layers a draft's speculators config names: EAGLE-3's and P-EAGLE's
    eagle_aux_hidden_state_layer_ids, DFlash's aux_hidden_state_layer_ids (vLLM captures the
    same layers for both). Pure."""
    ids = getattr(config, "eagle_aux_hidden_state_layer_ids", None) or getattr(
        config, "aux_hidden_state_layer_ids", None
    )
    return list(ids or [])


def verifier_ids(model, draft_index: torch.Tensor) -> torch.Tensor:
    """The verifier's token ids of a draft's draft-vocabulary predictions (d2t holds offsets:
    target = index + d2t[index]); unchanged when the draft predicts the whole vocabulary."""
    index = draft_index.long()
    return index + model.d2t[index] if model.use_draft_vocab else index
