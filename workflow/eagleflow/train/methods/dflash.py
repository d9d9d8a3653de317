"""DFlash (`train.method: dflash`) and what its family shares (BlockDrafter: DFlash2 and
DSpark are built the same way): one forward over a block, the anchor (the bonus token) and
`block_size - 1` mask tokens attending bidirectionally to each other and to the verifier's
states before the anchor, in Qwen3-shaped layers. Trained without the shift (speculators
applies shift_batch to eagle3 and peagle only). A trained block fixes the tokens vLLM drafts
(block_size - 1, or block_size when the anchor's slot is sampled too), so
`benchmark.num_speculative_tokens` does not apply."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from eagleflow.train.methods.base import DraftMethod, Serving, Verifier

if TYPE_CHECKING:
    from eagleflow.train.config import TrainConfig


class BlockDrafter(DraftMethod):
    """A method of the DFlash family, in speculators' config and model classes."""

    shifted = False
    block = True
    sample_from_anchor: ClassVar[bool] = False  # speculators' default for each method

    def positions(self, cfg: TrainConfig) -> list[int]:
        """The block's drafted slots: after the anchor, or from it when it is sampled too."""
        return list(range(0 if self.sample_from_anchor else 1, cfg.block_size))

    def draft_config(self, verifier: Verifier, cfg: TrainConfig, draft_vocab_size: int, aux_layer_ids, attn_impl):
        from transformers import Qwen3Config

        from eagleflow.train.draft import draft_layer_config

        return self.config_class(
            # vLLM's DFlash model is Qwen3-shaped for every verifier.
            transformer_layer_config=draft_layer_config(
                verifier.config, cfg.num_layers, attn_impl, cfg.sliding_window, config_class=Qwen3Config
            ),
            draft_vocab_size=draft_vocab_size,
            block_size=cfg.block_size,
            aux_hidden_state_layer_ids=list(aux_layer_ids),
            mask_token_id=verifier.mask_token_id(),
            # speculators trains full-attention layers bidirectionally within a block, and
            # sliding-window ones causally unless this is set; vLLM reads this one flag for
            # every layer (dflash_config.causal = not it). Set, vLLM serves full-attention
            # layers as they trained; a sliding window is trained bidirectional to match.
            sliding_window_non_causal=True,
            sample_from_anchor=self.sample_from_anchor,
            speculators_config=self.speculators_config(verifier, self.draft_tokens(cfg)),
        )

    def positions_per_batch(self, cfg: TrainConfig) -> float:
        """Each anchor's block, up to the anchors speculators' trainer samples a batch."""
        return min(cfg.batch_tokens, self.forward_kwargs(cfg, "eager")["max_anchors"]) * cfg.block_size


class DFlash(BlockDrafter):
    name = "dflash"
    serving = Serving("dflash", takes_k=False)
    estimate = "speculators' expected accepted length per block"

    @property
    def propose(self):
        from eagleflow.train.proposals import block_proposals

        return block_proposals
