"""What every draft method is (DraftMethod) and what building a draft takes (DraftSpec,
Verifier). A method is a subclass in a module of its own (train/methods/<name>.py) that sets
the class attributes and the hooks marked so below; the rest is the same for every method.

The modules import nothing heavy at their top: the workflow reads a method's facts (how vLLM
serves it, where, its report's wording) while it plans the DAG, and torch, transformers and
speculators load only where a draft is built, trained, exported or counted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

    from eagleflow.train.config import TrainConfig


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
class Verifier:
    """What a draft's config takes from its verifier: the text config (common.verifier_config)
    and the directory it is in; none for the plan's drafts, built from a config.json alone."""

    config: dict[str, Any]
    path: str | None = None

    def speculators_config(self):
        """speculators' VerifierConfig: its architectures, read from its config.json."""
        from speculators.config import VerifierConfig

        if self.path is None:
            return VerifierConfig(name_or_path=None, architectures=list(self.config.get("architectures") or []))
        return VerifierConfig.from_pretrained(self.path)

    def mask_token_id(self) -> int:
        """The token P-EAGLE and DFlash feed at the positions they draft, as speculators' trainer
        picks it: the tokenizer's mask token, else a new one in an unused embedding row, else
        pad, eos or unk. Without the tokenizer (the plan's counts) any id: no size depends on it."""
        if self.path is None:
            return 0
        from speculators.train.utils import resolve_mask_token_id

        return int(resolve_mask_token_id(self.path, int(self.config["vocab_size"])))


@dataclass(frozen=True)
class Serving:
    """How vLLM serves a method's drafts (`--speculative-config`): vLLM's name for the method,
    whether `benchmark.num_speculative_tokens` sets how many tokens it drafts (a chain, any
    length) or the checkpoint's trained length does, and vLLM's parallel drafting."""

    vllm_method: str
    takes_k: bool
    parallel_drafting: bool = False


class DraftMethod:
    """A draft method (`train.method`): one of speculators' draft models, by speculators' own
    registry name, with how eagleflow builds, trains, evaluates, exports, plans and serves it."""

    name: ClassVar[str]  # train.method, and speculators' registry name of its model and config
    serving: ClassVar[Serving]
    estimate: ClassVar[str]  # how `summarise` estimates the acceptance length, in the report's words
    shifted: ClassVar[bool] = True  # samples pair token t+1 with the state at t (train.data.shift)
    chain: ClassVar[bool] = False  # EAGLE-3's chain: per-step metrics
    # A block drafter: one forward over a block attending both ways (parity checks the causality
    # vLLM serves it with), its loss reporting the block's expected accepted length.
    block: ClassVar[bool] = False
    gpu_only: ClassVar[str | None] = None  # why vLLM serves it on GPUs only (the config check refuses vllm-cpu)
    whole_vocabulary: ClassVar[bool] = False  # drafts over the verifier's whole vocabulary
    # The architectures of the drafts it exports in vLLM's own format rather than speculators'
    # (config.json without speculators_model_type): how method_of knows them again.
    vllm_architectures: ClassVar[tuple[str, ...]] = ()

    # --- hooks: what a method's module says ------------------------------------------------------

    def positions(self, cfg: TrainConfig) -> list[int]:
        """The draft positions its metrics report (EAGLE-3's chain steps, or the block's or
        depths' positions, as speculators' compute_metrics names them)."""
        raise NotImplementedError

    def draft_config(self, verifier: Verifier, cfg: TrainConfig, draft_vocab_size: int, aux_layer_ids, attn_impl):
        """speculators' config of a fresh draft (its config class: `config_class`)."""
        raise NotImplementedError

    def positions_per_batch(self, cfg: TrainConfig) -> float:
        """Positions a training batch of `batch_tokens` runs the draft's layers on (the plan's
        activation memory)."""
        raise NotImplementedError

    @property
    def propose(self) -> Callable[[Any, Any, int], list[list[int]]] | None:
        """Every anchor's proposals over a sample in this method's alignment (train.proposals):
        what the evaluation and the parity replay walk. None: its drafting is not replayed."""
        return None

    def unservable(self, train: dict[str, Any]) -> list[str]:
        """What in a `train` section vLLM cannot serve as this method's draft, one message per
        setting. Pure. Checked before any job (the config check) and when a draft is built."""
        if train["draft_attention"] == "mla":
            return [f"train.draft_attention: mla is an EAGLE-3 draft layer; a {self.name} draft is served with its own"]
        return []

    def export(self, model, weights: dict[str, torch.Tensor], out_dir) -> None:
        """Write `weights` (bfloat16) in `model`'s architecture as vLLM loads it: speculators'
        checkpoint format, which leaves out the verifier's own tensors the model names."""
        model.save_pretrained(out_dir, state_dict=weights)

    def exported(self, model, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The tensors `export` writes of a state dict (the plan counts their bytes)."""
        skipped = set(getattr(model, "_keys_to_ignore_on_save", None) or [])
        return {k: v for k, v in state_dict.items() if k not in skipped}

    def reload(self, draft_dir: str, attn_impl: str | None):
        """An exported draft as its speculators model, without the tensors its checkpoint
        leaves out (train.draft.load_draft adds the verifier's). speculators' from_pretrained
        would resolve the verifier through AutoConfig without trust_remote_code: the config and
        weights load through transformers' PreTrainedModel path instead."""
        from transformers import PreTrainedModel

        config = reloaded_config(self.config_class.from_pretrained(draft_dir), draft_dir, attn_impl)
        return PreTrainedModel.from_pretrained.__func__(self.model_class, draft_dir, config=config)

    # --- the same for every method ---------------------------------------------------------------

    @property
    def model_class(self) -> type:
        """speculators' draft model class, from its registry."""
        from speculators import SpeculatorModel

        return SpeculatorModel.registry[self.name]

    @property
    def config_class(self) -> type:
        from speculators import SpeculatorModelConfig

        return SpeculatorModelConfig.registry[self.name]

    @property
    def align(self) -> Callable[..., Any]:
        """A sample in this method's alignment: train.data.shift or train.data.unshifted."""
        from eagleflow.train.data import shift, unshifted

        return shift if self.shifted else unshifted

    def served(self) -> dict[str, Any]:
        """How the benchmark serves its drafts (benchmark.speculative): its name and Serving, as
        data: the benchmark rule's param, so that the benchmark's code names no method."""
        return {"method": self.name, **dataclasses.asdict(self.serving)}

    def draft_tokens(self, cfg: TrainConfig) -> int:
        """The tokens one draft step proposes, as training trains them (EAGLE-3's chain steps,
        P-EAGLE's depths, a block's drafted slots): the checkpoint's greedy proposal length."""
        return len(self.positions(cfg))

    def speculators_config(self, verifier: Verifier, draft_tokens: int):
        """The checkpoint's speculators_config: the method, its greedy proposal of
        `draft_tokens` (draft_tokens), the verifier."""
        from speculators.config import SpeculatorsConfig
        from speculators.proposals.greedy import GreedyTokenProposalConfig

        return SpeculatorsConfig(
            algorithm=self.name,
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=draft_tokens)],
            default_proposal_method="greedy",
            verifier=verifier.speculators_config(),
        )

    def build(self, spec: DraftSpec, cfg: TrainConfig) -> torch.nn.Module:
        """A freshly initialised draft with the verifier's embeddings and lm_head rows loaded."""
        from eagleflow.common.verifier_config import read_text_config
        from eagleflow.train.attention import register
        from eagleflow.train.draft import load_verifier_weights

        if problems := self.unservable(dataclasses.asdict(cfg)):
            raise ValueError("; ".join(problems))
        register()
        verifier = Verifier(read_text_config(spec.verifier_dir), spec.verifier_dir)
        config = self.draft_config(verifier, cfg, int(spec.d2t.shape[0]), spec.aux_layer_ids, spec.attn_impl)
        model = self.model_class(config=config)
        model.load_vocab_mappings(spec.t2d, spec.d2t)
        load_verifier_weights(model, spec.verifier_dir, spec.t2d)
        return model

    def meta_draft(self, verifier_config: dict[str, Any], cfg: TrainConfig, draft_vocab_size: int, num_aux: int):
        """The draft `build` makes, on the meta device (shapes, no storage) and with the same
        parameters frozen, from the verifier's text config alone: what the plan counts."""
        import torch

        from eagleflow.train.draft import set_trainable

        config = self.draft_config(Verifier(verifier_config), cfg, draft_vocab_size, list(range(num_aux)), "sdpa")
        with torch.device("meta"):
            model = self.model_class(config=config)
        set_trainable(model)
        return model

    def forward_kwargs(self, cfg: TrainConfig, loss_implementation: str) -> dict[str, Any]:
        """The keyword arguments of the draft's training forward, from speculators' own
        get_trainer_kwargs (the loss, and each method's sampling: P-EAGLE's depths, DFlash's
        anchors)."""
        train_kwargs, _ = self.model_class.get_trainer_kwargs(
            loss_fn=cfg.loss,
            loss_implementation=loss_implementation,
            ttt_steps=cfg.ttt_steps,
            ttt_step_loss_decay=cfg.ttt_step_loss_decay,
            num_depths=cfg.num_depths,
        )
        return train_kwargs

    def attn_impl(self, attn_impl: str) -> str:
        """The attention it trains with: doc_sdpa (train/attention.py) reads EAGLE-3's chain
        mask; the others take SDPA over speculators' own dense mask where flex attention is not
        used."""
        from eagleflow.train.attention import DOC_SDPA

        return "sdpa" if attn_impl == DOC_SDPA and not self.chain else attn_impl

    def vocabulary_problem(self, draft_vocab_size: int, verifier_vocab_size: int) -> str | None:
        """Why `vocab.draft_vocab_size` does not fit this method, None when it does. Pure."""
        if self.whole_vocabulary and draft_vocab_size != verifier_vocab_size:
            return (
                f"train.method: {self.name} drafts over the verifier's whole vocabulary: set "
                f"vocab.draft_vocab_size to {verifier_vocab_size} (it is {draft_vocab_size})"
            )
        return None

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
        if self.block:
            keys += ["eal_sum", "eal_total"]
        return keys

    def summarise(self, totals: dict[str, float], cfg: TrainConfig) -> dict[str, float]:
        """Means from summed metrics: loss per batch, accuracy per draft position, and the
        estimated acceptance length. Pure.

        A chain: 1 + sum_k full_acc_k, where full_acc_k is the fraction of anchors whose first
        k+1 draft tokens were all right. A block drafter: speculators' expected accepted length,
        each block's leading run of right tokens plus the bonus token. Otherwise only each
        position's accuracy: 1 + sum_d prod_{j<=d} acc_j, as if positions erred independently."""

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
        if self.block:
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


def reloaded_config(config, draft_dir: str, attn_impl: str | None):
    """An exported draft's speculators config as reload builds its model: `attn_impl` in place
    of the attention it trained with (its default, flex attention, has no CPU backend), and
    refused without the aux layers it reads (eagleflow always writes them)."""
    from eagleflow.train.draft import draft_aux_layer_ids

    if attn_impl is not None:
        config.transformer_layer_config._attn_implementation = attn_impl
    if not draft_aux_layer_ids(config):
        raise ValueError(f"{draft_dir}/config.json has no aux hidden state layer ids")
    return config
