"""Parity's checks (benchmark.parity): what makes serving and training disagree, each a
Finding that names what to check. Pure."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagleflow.train.methods import method_of


@dataclass(frozen=True)
class ParityConfig:
    """The `parity` config section."""

    enabled: bool
    tolerance: float
    training_tolerance: float
    min_target_agreement: float
    on_gap: str


class ParityError(RuntimeError):
    """Serving and training disagree beyond the configured tolerance (parity.on_gap: fail)."""


@dataclass(frozen=True)
class Finding:
    check: str
    detail: str
    what_to_check: str


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where two token lists differ (or one ends); None if equal. Pure."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def check_targets(agreement: float | None, greedy_data: bool, cfg: ParityConfig) -> list[Finding]:
    """Training's targets against the data's next tokens (train.evaluation.target_agreement). On
    greedy data they are the same token; elsewhere sampling makes them differ. Pure."""
    if agreement is None or not greedy_data or agreement >= cfg.min_target_agreement:
        return []
    return [
        Finding(
            "training_targets",
            f"the argmax of training's targets is the verifier's own next token at {agreement:.1%} of the eval "
            f"positions on greedy data (at least {cfg.min_target_agreement:.0%} expected)",
            "the targets training builds, verifier_lm_head(verifier_norm(final state)): the verifier's final "
            "norm and lm_head loaded into the draft, the final state's layer (the last layer's pre-norm output)",
        )
    ]


def check_gaps(
    served: float, replay: float, replay_every_anchor: float, train_estimate: float | None, cfg: ParityConfig
) -> list[Finding]:
    """Findings from the three acceptance lengths. Pure."""
    out = []
    if abs(served - replay) > cfg.tolerance:
        out.append(
            Finding(
                "replay_vs_vllm",
                f"vLLM measured mean acceptance length {served:.3f}, the replay of the same streams "
                f"{replay:.3f} (gap {served - replay:+.3f}, tolerance {cfg.tolerance})",
                "serving runs another draft than the one trained: eagle_aux_hidden_state_layer_ids and "
                "d2t in the exported draft, the draft config vLLM reads (norm_before_residual, "
                "transformer_layer_config), the server dtype",
            )
        )
    if train_estimate is not None and train_estimate - replay_every_anchor > cfg.training_tolerance:
        out.append(
            Finding(
                "training_vs_replay",
                f"training estimated {train_estimate:.3f} on its eval split; the replay over every "
                f"anchor of the served streams gives {replay_every_anchor:.3f} "
                f"(gap {replay_every_anchor - train_estimate:+.3f}, tolerance {cfg.training_tolerance})",
                "the draft learned targets other than the verifier's greedy tokens (the verifier's final "
                "norm and lm_head in training), or the benchmark's prompts differ from the training data "
                "(chat template, system prompt, style, benchmark.max_tokens against generate.max_tokens)",
            )
        )
    return out


def check_training_vs_served(train_estimate: float | None, served: float, cfg: ParityConfig) -> list[Finding]:
    """Training's estimate against vLLM's measure, where no replay splits the gap. Pure."""
    if train_estimate is None or train_estimate - served <= cfg.training_tolerance:
        return []
    return [
        Finding(
            "training_vs_vllm",
            f"training estimated {train_estimate:.3f} on its eval split; vLLM measured {served:.3f} "
            f"(gap {served - train_estimate:+.3f}, tolerance {cfg.training_tolerance})",
            "what a replay would separate: the draft vLLM runs (its config as vLLM reads it: causality, "
            "mask token, aux layers, d2t) and the data it is served (prompt format, lengths, style)",
        )
    ]


def check_block_causality(draft_config: dict) -> list[Finding]:
    """A block drafter's attention as vLLM will run it against how speculators trained it.
    speculators trains full-attention layers bidirectionally within a block, and sliding-window
    layers causally unless sliding_window_non_causal; vLLM reads that one flag for every layer
    (dflash_config.causal = not it). Pure."""
    if not method_of(draft_config).block:
        return []
    layer_types = draft_config.get("transformer_layer_config", {}).get("layer_types") or ["full_attention"]
    non_causal = bool(draft_config.get("sliding_window_non_causal", False))
    trained = {("bidirectional" if t == "full_attention" or non_causal else "causal") for t in layer_types}
    served = "bidirectional" if non_causal else "causal"
    if trained == {served}:
        return []
    return [
        Finding(
            "block_causality",
            f"the draft's layers trained {' and '.join(sorted(trained))} within a block; vLLM serves every "
            f"layer {served} (sliding_window_non_causal: {non_causal})",
            "sliding_window_non_causal in the draft's config.json, and the draft's layer_types: vLLM applies "
            "one causality to every layer",
        )
    ]


def check_aux_layer_ids(exported: list[int], trained: list[int]) -> list[Finding]:
    if list(exported) == list(trained):
        return []
    return [
        Finding(
            "aux_layer_ids",
            f"the exported draft names aux layers {list(exported)}; training used {list(trained)}",
            "eagle_aux_hidden_state_layer_ids in the draft's config.json: vLLM captures the layers it names",
        )
    ]


def check_d2t(exported: torch.Tensor | None, trained: torch.Tensor) -> list[Finding]:
    if exported is None:
        found = "no d2t"
    elif exported.shape != trained.shape:
        found = f"a d2t of {exported.shape[0]} entries"
    elif torch.equal(exported.long(), trained.long()):
        return []
    else:
        different = int((exported.long() != trained.long()).sum())
        found = f"a d2t of {exported.shape[0]} entries, {different} of them different"
    return [
        Finding(
            "d2t",
            f"the exported draft holds {found}; the vocab stage's map has {trained.shape[0]}",
            "d2t in the draft's model.safetensors: vLLM maps the draft's tokens to the verifier's with it",
        )
    ]


def check_prompt_format(streams: list[dict], expected: dict[str, list[int]]) -> list[Finding]:
    """Served prompt ids against the chat template as synth applies it, per prompt id. Pure."""
    bad = []
    for s in streams:
        at = first_difference(s["prompt_token_ids"], expected[s["id"]])
        if at is not None:
            bad.append((s["id"], at))
    if not bad:
        return []
    sid, at = bad[0]
    return [
        Finding(
            "prompt_format",
            f"{len(bad)} of {len(streams)} benchmark prompts were served as other tokens than synth's chat "
            f"template gives for the same messages (first: {sid}, from token {at})",
            "the chat template and chat_template_kwargs of the benchmark server against synth's "
            "(server.extra_args --chat-template, generate.chat_template_kwargs)",
        )
    ]
