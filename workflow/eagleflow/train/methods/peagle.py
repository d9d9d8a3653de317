"""P-EAGLE (`train.method: peagle`): EAGLE-3's layer drafting `num_depths` tokens in one
forward (the real token and state, then mask tokens and a learned mask state), trainable
embeddings, trained on speculators' COD sampling. vLLM serves it as `eagle3` with
`parallel_drafting` (vLLM does not infer it from the checkpoint's method when a method is
named), at its trained depths."""

from __future__ import annotations

from typing import TYPE_CHECKING

from eagleflow.train.methods.base import DraftMethod, Serving, Verifier
from eagleflow.train.methods.eagle3 import on_eagle3_layers

if TYPE_CHECKING:
    from eagleflow.train.config import TrainConfig


class PEagle(DraftMethod):
    name = "peagle"
    serving = Serving("eagle3", takes_k=False, parallel_drafting=True)
    estimate = "1 + sum over depths of the product of accuracies so far"

    def positions(self, cfg: TrainConfig) -> list[int]:
        return list(range(cfg.num_depths))

    def draft_config(self, verifier: Verifier, cfg: TrainConfig, draft_vocab_size: int, aux_layer_ids, attn_impl):
        return on_eagle3_layers(
            self, verifier, cfg, draft_vocab_size, aux_layer_ids, attn_impl, mask_token_id=verifier.mask_token_id()
        )

    def positions_per_batch(self, cfg: TrainConfig) -> float:
        """COD sampling: every token at depth 0, then a decaying share at each further depth
        (speculators' down-sampling ratio and floor, as its trainer passes them)."""
        sampling = self.forward_kwargs(cfg, "eager")
        ratio, floor = sampling["down_sample_ratio"], sampling["down_sample_ratio_min"]
        return cfg.batch_tokens * (1 + sum(max(ratio**d, floor) for d in range(1, cfg.num_depths)))

    @property
    def propose(self):
        from eagleflow.train.proposals import parallel_proposals

        return parallel_proposals
