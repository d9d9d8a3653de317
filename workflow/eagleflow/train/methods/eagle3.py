"""EAGLE-3 (`train.method: eagle3`): a chain of `ttt_steps` draft tokens, each step fed the
previous one, with the two EAGLE-3.1 norms as settings (`norm_before_fc`, `norm_output`).

The draft's decoder layer copies the verifier's attention geometry (hidden size, heads,
head_dim, rope) so that vLLM's EAGLE-3 implementation can serve it next to the verifier. Two
draft layers (`train.draft_attention`):
- `llama`: a Llama decoder layer (speculators' Eagle3DraftModel), exported in the
  speculators checkpoint format; for MLA verifiers with one KV head per query head.
- `mla`: multi-head latent attention as the verifier has it (train/methods/eagle3_mla.py),
  exported in vLLM's own format.

vLLM serves a chain at any length: `benchmark.num_speculative_tokens` sets it, whatever
training's ttt_steps was.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from eagleflow.train.methods.base import DraftMethod, Serving, Verifier
from eagleflow.train.methods.eagle3_mla import MLA_ARCHITECTURE, SPECULATORS_SIDECAR

if TYPE_CHECKING:
    from eagleflow.train.config import TrainConfig


def on_eagle3_layers(
    method: DraftMethod,
    verifier: Verifier,
    cfg: TrainConfig,
    draft_vocab_size: int,
    aux_layer_ids,
    attn_impl: str,
    **fields,
):
    """speculators' config of a draft on EAGLE-3's layers, in `method`'s config class with its
    proposal (P-EAGLE drafts its depths on the same layers); `fields`: the method's own."""
    from eagleflow.train.draft import draft_layer_config
    from eagleflow.train.methods.eagle3_mla import mla_layer_config, register_mla_draft_layer

    if cfg.draft_attention == "mla":
        register_mla_draft_layer()
        layer = mla_layer_config(verifier.config, cfg.num_layers, attn_impl)
    else:
        layer = draft_layer_config(verifier.config, cfg.num_layers, attn_impl, cfg.sliding_window)
    return method.config_class(
        transformer_layer_config=layer,
        draft_vocab_size=draft_vocab_size,
        norm_before_residual=True,
        norm_before_fc=cfg.norm_before_fc,
        norm_output=cfg.norm_output,
        eagle_aux_hidden_state_layer_ids=list(aux_layer_ids),
        **fields,
        speculators_config=method.speculators_config(verifier, method.draft_tokens(cfg)),
    )


class Eagle3(DraftMethod):
    name = "eagle3"
    serving = Serving("eagle3", takes_k=True)
    estimate = "1 + sum(full_acc_k)"
    chain = True
    vllm_architectures = (MLA_ARCHITECTURE,)

    def positions(self, cfg: TrainConfig) -> list[int]:
        return list(range(cfg.ttt_steps))

    def draft_config(self, verifier: Verifier, cfg: TrainConfig, draft_vocab_size: int, aux_layer_ids, attn_impl):
        return on_eagle3_layers(self, verifier, cfg, draft_vocab_size, aux_layer_ids, attn_impl)

    def positions_per_batch(self, cfg: TrainConfig) -> float:
        """The chain runs the layers on every token at each of its ttt_steps."""
        return cfg.batch_tokens * cfg.ttt_steps

    @property
    def propose(self):
        from eagleflow.train.proposals import chain_proposals

        return chain_proposals

    def unservable(self, train: dict[str, Any]) -> list[str]:
        """vLLM's MLA draft layer (`draft_attention: mla`) has no sliding window and no norm
        before fc."""
        if train["draft_attention"] != "mla":
            return []
        problems = []
        if train["sliding_window"] is not None:
            problems.append("train.sliding_window: vLLM's MLA draft layer has no sliding window; set it to null")
        if train["norm_before_fc"]:
            problems.append("train.norm_before_fc: vLLM's MLA draft layer has no norm before fc; set it to false")
        return problems

    def export(self, model, weights, out_dir) -> None:
        from eagleflow.train.methods.eagle3_mla import export_mla_draft, is_mla_draft

        if is_mla_draft(model):
            export_mla_draft(model, weights, out_dir)
        else:
            super().export(model, weights, out_dir)

    def exported(self, model, state_dict):
        from eagleflow.train.methods.eagle3_mla import is_mla_draft, mla_exported

        return mla_exported(state_dict) if is_mla_draft(model) else super().exported(model, state_dict)

    def reload(self, draft_dir: str, attn_impl: str | None):
        from pathlib import Path

        from eagleflow.train.methods.eagle3_mla import reload_mla_draft

        if (Path(draft_dir) / SPECULATORS_SIDECAR).is_file():
            return reload_mla_draft(self, draft_dir, attn_impl)
        return super().reload(draft_dir, attn_impl)
