"""Build, export and reload an EAGLE-3 draft in the speculators checkpoint format.

The draft's decoder layer copies the verifier's attention geometry (hidden size, heads,
head_dim, rope) so that vLLM's EAGLE-3 implementation can serve it next to the verifier.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, LlamaConfig

log = logging.getLogger(__name__)


def draft_layer_config(
    verifier_dir: str, num_layers: int, attn_impl: str, trust_remote_code: bool = False, sliding_window: int | None = None,
) -> LlamaConfig:  # fmt: skip
    """The draft decoder's config. `sliding_window` None: full attention in every draft layer;
    an int: that window in every layer (speculators' own trainer defaults to 2048)."""
    v = AutoConfig.from_pretrained(verifier_dir, trust_remote_code=trust_remote_code)
    v = getattr(v, "text_config", v)
    heads = v.num_attention_heads
    config = LlamaConfig(
        vocab_size=v.vocab_size,
        hidden_size=v.hidden_size,
        intermediate_size=v.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=getattr(v, "num_key_value_heads", heads) or heads,
        head_dim=getattr(v, "head_dim", None) or v.hidden_size // heads,
        hidden_act="silu",
        max_position_embeddings=v.max_position_embeddings,
        rms_norm_eps=v.rms_norm_eps,
        rope_parameters=getattr(v, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        sliding_window=sliding_window,
        use_sliding_window=sliding_window is not None,
        layer_types=["sliding_attention" if sliding_window is not None else "full_attention"] * num_layers,
    )
    config._attn_implementation = attn_impl
    return config


def build_draft(
    verifier_dir: str, d2t: torch.Tensor, t2d: torch.Tensor, *, num_layers: int, ttt_steps: int,
    aux_layer_ids: list[int], attn_impl: str, norm_before_residual: bool = True, sliding_window: int | None = None,
):  # fmt: skip
    """A freshly initialised draft with the verifier's embeddings and lm_head rows loaded."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    config = Eagle3SpeculatorConfig(
        transformer_layer_config=draft_layer_config(verifier_dir, num_layers, attn_impl, sliding_window=sliding_window),
        draft_vocab_size=int(d2t.shape[0]),
        norm_before_residual=norm_before_residual,
        eagle_aux_hidden_state_layer_ids=list(aux_layer_ids),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=ttt_steps)],
            default_proposal_method="greedy",
            verifier=VerifierConfig.from_pretrained(verifier_dir),
        ),
    )
    model = Eagle3DraftModel(config=config)
    model.load_vocab_mappings(t2d, d2t)
    model.load_verifier_weights()
    return model


def export_draft(model, state_dict: dict[str, torch.Tensor], out_dir: Path, serve_verifier_path: str) -> None:
    """Save `state_dict` in `model`'s architecture as a speculators checkpoint in `out_dir`.

    The checkpoint names the verifier path that will *serve* it, which on a cluster is
    usually not the path the draft was trained from.
    """
    model.config.speculators_config.verifier.name_or_path = serve_verifier_path
    model.save_pretrained(out_dir, state_dict={k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state_dict.items()})


def load_draft_weights(draft_dir: str) -> dict[str, torch.Tensor]:
    return load_file(str(Path(draft_dir) / "model.safetensors"))
