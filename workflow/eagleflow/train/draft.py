"""Build, export and reload a draft, whatever its method (train/methods/): the layer config
its decoder copies from the verifier, the verifier's own tensors in it (embeddings, heads, final
norm), and the export and reload that go through its method.

The draft's decoder layer copies the verifier's attention geometry (hidden size, heads,
head_dim, rope) so that vLLM can serve it next to the verifier. Everything is read from the
verifier's config.json and safetensors by name, never by running its model code: custom-code
verifiers (Kimi-K2's `kimi_k2`, loaded with trust_remote_code) build drafts the same way as
Llama.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig

from eagleflow.common.verifier_config import draft_attention_geometry, is_mla
from eagleflow.common.verifier_weights import load_verifier_embeddings, load_verifier_final_norm
from eagleflow.train.attention import register as register_attention
from eagleflow.train.methods import draft_method, method_of

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


def draft_layer_config(
    v: dict[str, Any],
    num_layers: int,
    attn_impl: str,
    sliding_window: int | None = None,
    config_class=LlamaConfig,
):
    """The draft decoder's config, for the verifier of text config `v`
    (common.verifier_config.read_text_config). `sliding_window` None: full attention in every
    draft layer; an int: that window in every layer (speculators' own trainer defaults to
    2048). `config_class`: the layer's transformers config, Llama's (EAGLE-3, P-EAGLE) or
    Qwen3's (DFlash), with the verifier's attention geometry either way."""
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
    set_trainable(model)


def freeze_verifier_parts(model) -> None:
    """The verifier's own tensors in the draft (embeddings, head, final norm) take no gradient."""
    for p in (
        model.embed_tokens.weight,
        model.lm_head.weight,
        model.verifier_lm_head.weight,
        model.verifier_norm.weight,
    ):
        p.requires_grad_(False)


def set_trainable(model) -> None:
    """What a fresh draft trains: none of the verifier's tensors (freeze_verifier_parts), and
    its embeddings where its config says so (EAGLE-3 freezes them by default, P-EAGLE trains
    them; DFlash has no such setting)."""
    freeze_verifier_parts(model)
    model.embed_tokens.weight.requires_grad_(getattr(model.config, "embed_requires_grad", False))


def take_precomputed_targets(model) -> None:
    """Training on shards with the compact target (hidden_states.target: topk): the batch
    brings the verifier's logits on the draft vocabulary themselves, in the place of the final
    state, so the forward's verifier_lm_head(verifier_norm(.)) must pass them through. Neither
    module is part of the exported draft."""
    from torch import nn

    model.verifier_norm = nn.Identity()
    model.verifier_lm_head = nn.Identity()


def export_draft(model, state_dict: dict[str, torch.Tensor], out_dir: Path, serve_verifier_path: str) -> None:
    """Save `state_dict` in `model`'s architecture in `out_dir`, as vLLM loads it: in bfloat16,
    in its method's format (DraftMethod.export: speculators' checkpoint, or vLLM's own for
    EAGLE-3's MLA draft).

    The checkpoint names the verifier path that will *serve* it, which on a cluster is
    usually not the path the draft was trained from.
    """
    model.config.speculators_config.verifier.name_or_path = serve_verifier_path
    weights = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state_dict.items()}
    draft_method(model.config.speculators_model_type).export(model, weights, Path(out_dir))


def load_draft(draft_dir: str, verifier_dir: str | None = None, attn_impl: str | None = None):
    """Reload an exported draft as the speculators model of its method, for any verifier.

    Its method (train.methods.method_of its config.json) reloads the draft's own tensors
    (DraftMethod.reload); the frozen verifier_lm_head (not saved in the checkpoint) and
    verifier_norm, and what else the checkpoint leaves out, are read from `verifier_dir`
    (default: the path the checkpoint names) by tensor name. `attn_impl` overrides the
    attention the checkpoint was trained with (its default, flex attention, has no CPU
    backend). In float32, as it trained: the checkpoint stores bfloat16 for vLLM, and a CPU
    computes in float32 only.
    """
    register_attention()
    method = method_of(json.loads((Path(draft_dir) / "config.json").read_text()))
    model = method.reload(draft_dir, attn_impl)
    verifier_dir = verifier_dir or model.config.speculators_config.verifier.name_or_path
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
