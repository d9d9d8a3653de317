"""Pure math over vLLM's Prometheus counters: deltas around a workload and acceptance figures.

vLLM counts, per engine: `spec_decode_num_drafts` (draft proposals), `..._num_draft_tokens`
(tokens proposed), `..._num_accepted_tokens` (tokens accepted) and
`..._num_accepted_tokens_per_pos{position=i}`. Mean acceptance length counts the bonus
token the verifier always contributes: 1 + accepted / drafts.
"""

from __future__ import annotations

from collections import defaultdict

from eagleflow.common.acceptance import acceptance_figures
from eagleflow.common.prometheus import parse_prometheus

PREFIX = "vllm:spec_decode_"


def spec_decode_counters(text: str) -> dict[str, float | dict[int, float]]:
    """Sum the spec-decode counters over engines/models; per-position counts by position. Pure."""
    totals: dict[str, float] = defaultdict(float)
    per_pos: dict[int, float] = defaultdict(float)
    for (name, labels), value in parse_prometheus(text).items():
        if not name.startswith(PREFIX) or not name.endswith("_total"):
            continue
        key = name[len(PREFIX) : -len("_total")]
        if key == "num_accepted_tokens_per_pos":
            per_pos[int(dict(labels)["position"])] += value
        else:
            totals[key] += value
    return {**totals, "per_pos": dict(per_pos)}


def counter_delta(before: dict, after: dict) -> dict:
    """after - before, key by key (per-position dict too). Pure."""
    out = {}
    for key, value in after.items():
        if isinstance(value, dict):
            prev = before.get(key, {})
            out[key] = {p: v - prev.get(p, 0.0) for p, v in value.items()}
        else:
            out[key] = value - before.get(key, 0.0)
    return out


def acceptance(delta: dict, num_speculative_tokens: int) -> dict[str, float | list[float]]:
    """Acceptance figures from counter deltas. Raises if no draft was proposed at all."""
    drafts = delta.get("num_drafts", 0.0)
    draft_tokens = delta.get("num_draft_tokens", 0.0)
    accepted = delta.get("num_accepted_tokens", 0.0)
    if drafts <= 0:
        raise ValueError(
            "vLLM reported no speculative drafts during the workload "
            "(vllm:spec_decode_num_drafts did not grow): the draft was not used"
        )
    per_pos = delta.get("per_pos", {})
    return acceptance_figures(
        drafts, draft_tokens, accepted, [per_pos.get(i, 0.0) for i in range(num_speculative_tokens)]
    )
