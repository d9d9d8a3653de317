"""Draft methods (`train.method`): which of speculators' draft models a run trains, the batch
alignment its data takes, the forward settings and metrics of its loss, and how it is
exported for vLLM. The models, losses and per-method data preparation (P-EAGLE's COD
sampling, DFlash's anchored blocks) are speculators' own; this module only configures them.

- `eagle3`: EAGLE-3 (with the two EAGLE-3.1 norms as settings), a chain of `ttt_steps` draft
  tokens, each step fed the previous one (train/draft.py builds it).
- `peagle`: P-EAGLE, EAGLE-3's layer drafting `num_depths` tokens in one forward (mask tokens
  and a learned mask state after the first), trainable embeddings. vLLM serves it as
  `eagle3` with `parallel_drafting`.
- `dflash`: DFlash, a block drafter: one forward over the anchor and `block_size - 1` mask
  tokens, attending to the verifier's states (Qwen3-shaped layers). Trained without the
  shift (speculators applies shift_batch to eagle3 and peagle only).
- `dflash2`: DFlash2, DFlash with two local convolutions a layer and a candidate selector
  that reranks the block's top tokens by their predecessor; it drafts over the verifier's whole
  vocabulary (vocab.draft_vocab_size must be the verifier's). vLLM serves its candidate head on
  the V2 model runner only (GPUs).
- `dspark`: DSpark, DFlash with a Markov logit-bias and a confidence head. vLLM serves it on
  its V2 model runner only (GPUs).

The registry maps a name to its DraftMethod; nothing else branches on the method's name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import Qwen3Config

from eagleflow.common.verifier_config import read_text_config
from eagleflow.train.config import TrainConfig
from eagleflow.train.data import shift, unshifted
from eagleflow.train.draft import build_draft, draft_layer_config, load_verifier_weights
from eagleflow.train.proposals import block_proposals, chain_proposals, parallel_proposals


@dataclass(frozen=True)
class DraftSpec:
    """What building a draft needs besides its train config: the verifier, the draft
    vocabulary's maps, the aux layers the states hold and the attention kernel."""

    verifier_dir: str
    d2t: torch.Tensor
    t2d: torch.Tensor
    aux_layer_ids: list[int]
    attn_impl: str


@dataclass(frozen=True)
class DraftMethod:
    name: str
    model_class: Callable[[], type]  # speculators' draft model class (imported on use)
    build: Callable[[DraftSpec, TrainConfig], torch.nn.Module]
    align: Callable[..., Any]  # train.data.shift or train.data.unshifted: a sample in this method's alignment
    # The draft positions its metrics report: EAGLE-3's chain steps, or the block's / depths'
    # positions, as speculators' compute_metrics names them.
    positions: Callable[[TrainConfig], list[int]]
    chain: bool  # EAGLE-3's chain: per-step metrics
    block_acceptance: bool  # the loss reports the expected accepted length of a block (eal)
    # Every anchor's proposals over a sample in this method's alignment (train.proposals): what
    # the evaluation and the parity replay walk. None: the method's drafting is not replayed.
    propose: Callable[[Any, Any, int], list[list[int]]] | None

    @property
    def shifted(self) -> bool:
        """Whether the method's samples pair token t+1 with the state at t (train.data.shift)."""
        return self.align is shift

    def draft_tokens(self, cfg: TrainConfig) -> int:
        """The tokens one draft step proposes, as training trains them (EAGLE-3's chain steps,
        P-EAGLE's depths, a block's drafted slots)."""
        return len(self.positions(cfg))

    def forward_kwargs(self, cfg: TrainConfig, loss_implementation: str) -> dict[str, Any]:
        """The keyword arguments of the draft's training forward, from speculators' own
        get_trainer_kwargs (the loss, and each method's sampling: P-EAGLE's depths, DFlash's
        anchors)."""
        train_kwargs, _ = self.model_class().get_trainer_kwargs(
            loss_fn=cfg.loss,
            loss_implementation=loss_implementation,
            ttt_steps=cfg.ttt_steps,
            ttt_step_loss_decay=cfg.ttt_step_loss_decay,
            num_depths=cfg.num_depths,
        )
        return train_kwargs

    def metric_keys(self, cfg: TrainConfig) -> list[str]:
        """The per-batch {name_sum, name_total} metrics summarise reads, in a fixed order (every
        rank reduces the same vector). `num_batches` counts the batches summed."""
        keys = ["num_batches", "loss_sum"]
        if self.chain:
            for k in range(cfg.ttt_steps):
                keys += [f"{n}_{k}_{t}" for n in ("loss", "full_acc", "cond_acc") for t in ("sum", "total")]
            return keys
        keys += ["full_acc_sum", "full_acc_total"]
        keys += [f"position_{p}_acc_{t}" for p in self.positions(cfg) for t in ("sum", "total")]
        if self.block_acceptance:
            keys += ["eal_sum", "eal_total"]
        return keys

    def summarise(self, totals: dict[str, float], cfg: TrainConfig) -> dict[str, float]:
        """Means from summed metrics: loss per batch, accuracy per draft position, and the
        estimated acceptance length. Pure.

        EAGLE-3: 1 + sum_k full_acc_k, where full_acc_k is the fraction of anchors whose first
        k+1 draft tokens were all right. DFlash, DFlash2, DSpark: speculators' expected accepted length,
        each block's leading run of right tokens plus the bonus token. P-EAGLE reports only each
        depth's accuracy: 1 + sum_d prod_{j<=d} acc_j, as if depths erred independently."""

        def ratio(name):
            t = totals[f"{name}_total"]
            return totals[f"{name}_sum"] / t if t else 0.0

        out = {"loss": totals["loss_sum"] / max(1.0, totals["num_batches"])}
        if self.chain:
            for k in range(cfg.ttt_steps):
                for name in ("loss", "full_acc", "cond_acc"):
                    out[f"{name}_{k}"] = ratio(f"{name}_{k}")
            out["estimated_acceptance_length"] = 1.0 + sum(out[f"full_acc_{k}"] for k in range(cfg.ttt_steps))
            return out
        out["full_acc"] = ratio("full_acc")
        accuracies = [ratio(f"position_{p}_acc") for p in self.positions(cfg)]
        for i, acc in enumerate(accuracies):
            out[f"position_acc_{i}"] = acc
        if self.block_acceptance:
            out["estimated_acceptance_length"] = ratio("eal")
        else:
            run, estimate = 1.0, 1.0
            for acc in accuracies:
                run *= acc
                estimate += run
            out["estimated_acceptance_length"] = estimate
        return out

    @staticmethod
    def first_accuracy(row: dict[str, float]) -> float:
        """The first draft token's accuracy in a summarised row, whatever the method."""
        return row["full_acc_0"] if "full_acc_0" in row else row["position_acc_0"]


# --- building each method's draft ---------------------------------------------------------------


def build_eagle3(spec: DraftSpec, cfg: TrainConfig) -> torch.nn.Module:
    return build_on_eagle3_layers(spec, cfg, cfg.ttt_steps, attention=cfg.draft_attention)


def build_peagle(spec: DraftSpec, cfg: TrainConfig) -> torch.nn.Module:
    from speculators.models.peagle import PEagleDraftModel, PEagleSpeculatorConfig

    return build_on_eagle3_layers(
        spec,
        cfg,
        cfg.num_depths,
        algorithm="peagle",
        config_class=PEagleSpeculatorConfig,
        model_class=PEagleDraftModel,
        extra={"mask_token_id": mask_token_id(spec.verifier_dir)},
    )


def build_on_eagle3_layers(spec: DraftSpec, cfg: TrainConfig, draft_tokens: int, **method) -> torch.nn.Module:
    """A draft of EAGLE-3's layer (train.draft.build_draft) proposing `draft_tokens`; `method`:
    the method's own algorithm, speculators classes and config fields (P-EAGLE)."""
    return build_draft(
        spec.verifier_dir,
        spec.d2t,
        spec.t2d,
        num_layers=cfg.num_layers,
        ttt_steps=draft_tokens,
        aux_layer_ids=spec.aux_layer_ids,
        attn_impl=spec.attn_impl,
        sliding_window=cfg.sliding_window,
        norm_before_fc=cfg.norm_before_fc,
        norm_output=cfg.norm_output,
        **method,
    )


def build_block_drafter(algorithm: str) -> Callable[[DraftSpec, TrainConfig], torch.nn.Module]:
    """DFlash, DFlash2 or DSpark, in speculators' config and model classes (DFlash2 with its
    convolution and selector defaults)."""

    def build(spec: DraftSpec, cfg: TrainConfig) -> torch.nn.Module:
        from speculators.config import SpeculatorsConfig, VerifierConfig
        from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
        from speculators.models.dflash2 import DFlash2DraftModel, DFlash2SpeculatorConfig
        from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig
        from speculators.proposals.greedy import GreedyTokenProposalConfig

        config_class, model_class = {
            "dflash": (DFlashSpeculatorConfig, DFlashDraftModel),
            "dflash2": (DFlash2SpeculatorConfig, DFlash2DraftModel),
            "dspark": (DSparkSpeculatorConfig, DSparkDraftModel),
        }[algorithm]
        sample_from_anchor = algorithm == "dspark"  # speculators' default for each
        config = config_class(
            # vLLM's DFlash model is Qwen3-shaped for every verifier.
            transformer_layer_config=draft_layer_config(
                spec.verifier_dir, cfg.num_layers, spec.attn_impl, cfg.sliding_window, config_class=Qwen3Config
            ),
            draft_vocab_size=int(spec.d2t.shape[0]),
            block_size=cfg.block_size,
            aux_hidden_state_layer_ids=list(spec.aux_layer_ids),
            mask_token_id=mask_token_id(spec.verifier_dir),
            # speculators trains full-attention layers bidirectionally within a block, and
            # sliding-window ones causally unless this is set; vLLM reads this one flag for
            # every layer (dflash_config.causal = not it). Set, vLLM serves full-attention
            # layers as they trained; a sliding window is trained bidirectional to match.
            sliding_window_non_causal=True,
            sample_from_anchor=sample_from_anchor,
            speculators_config=SpeculatorsConfig(
                algorithm=algorithm,
                proposal_methods=[
                    GreedyTokenProposalConfig(
                        speculative_tokens=cfg.block_size if sample_from_anchor else cfg.block_size - 1
                    )
                ],
                default_proposal_method="greedy",
                verifier=VerifierConfig.from_pretrained(spec.verifier_dir),
            ),
        )
        model = model_class(config=config)
        model.load_vocab_mappings(spec.t2d, spec.d2t)
        load_verifier_weights(model, spec.verifier_dir, spec.t2d)
        return model

    return build


def mask_token_id(verifier_dir: str) -> int:
    """The token P-EAGLE and DFlash feed at the positions they draft, as speculators' trainer
    picks it: the tokenizer's mask token, else a new one in an unused embedding row, else
    pad, eos or unk."""
    from speculators.train.utils import resolve_mask_token_id

    return int(resolve_mask_token_id(verifier_dir, int(read_text_config(verifier_dir)["vocab_size"])))


def speculators_class(module: str, name: str) -> Callable[[], type]:
    def load() -> type:
        import importlib

        return getattr(importlib.import_module(f"speculators.models.{module}"), name)

    return load


METHODS: dict[str, DraftMethod] = {
    "eagle3": DraftMethod(
        name="eagle3",
        model_class=speculators_class("eagle3", "Eagle3DraftModel"),
        build=build_eagle3,
        align=shift,
        positions=lambda cfg: list(range(cfg.ttt_steps)),
        chain=True,
        block_acceptance=False,
        propose=chain_proposals,
    ),
    "peagle": DraftMethod(
        name="peagle",
        model_class=speculators_class("peagle", "PEagleDraftModel"),
        build=build_peagle,
        align=shift,
        positions=lambda cfg: list(range(cfg.num_depths)),
        chain=False,
        block_acceptance=False,
        propose=parallel_proposals,
    ),
    "dflash": DraftMethod(
        name="dflash",
        model_class=speculators_class("dflash", "DFlashDraftModel"),
        build=build_block_drafter("dflash"),
        align=unshifted,
        positions=lambda cfg: list(range(1, cfg.block_size)),  # the anchor is the bonus token
        chain=False,
        block_acceptance=True,
        propose=block_proposals,
    ),
    "dflash2": DraftMethod(
        name="dflash2",
        model_class=speculators_class("dflash2", "DFlash2DraftModel"),
        build=build_block_drafter("dflash2"),
        align=unshifted,
        positions=lambda cfg: list(range(1, cfg.block_size)),
        chain=False,
        block_acceptance=True,
        propose=None,
    ),
    "dspark": DraftMethod(
        name="dspark",
        model_class=speculators_class("dspark", "DSparkDraftModel"),
        build=build_block_drafter("dspark"),
        align=unshifted,
        positions=lambda cfg: list(range(cfg.block_size)),  # samples from the anchor too
        chain=False,
        block_acceptance=True,
        propose=None,
    ),
}


def draft_method(name: str) -> DraftMethod:
    if name not in METHODS:
        raise ValueError(f"train.method: {name!r} is none of {', '.join(METHODS)}")
    return METHODS[name]


def method_attn_impl(method: DraftMethod, attn_impl: str) -> str:
    """The attention a method trains with: doc_sdpa (train/attention.py) reads EAGLE-3's chain
    mask; the others take SDPA over speculators' own dense mask where flex attention is not
    used."""
    from eagleflow.train.attention import DOC_SDPA

    return "sdpa" if attn_impl == DOC_SDPA and not method.chain else attn_impl
