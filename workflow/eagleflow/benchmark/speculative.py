"""vLLM's speculative config for an exported draft, by its method: what vLLM reads from a
speculators checkpoint (SpeculatorsConfig.build_vllm_speculative_config), with the number of
draft tokens set where the method lets a deployment choose it.

- EAGLE-3 proposes a chain; any length up to what serving can afford: `benchmark.
  num_speculative_tokens` (k) sets it, whatever training's ttt_steps was.
- P-EAGLE drafts its trained depths in one forward: vLLM's `eagle3` with `parallel_drafting`
  (vLLM does not infer it from the checkpoint's method when a method is named).
- DFlash, DFlash2 and DSpark draft a trained block in one forward: its size fixes the tokens
  (block_size - 1, or block_size when the anchor is sampled too), so k does not apply. vLLM
  serves DFlash2 as `dflash`, its candidate head named by the checkpoint's architecture.
- An MLA draft is written in vLLM's own format (no speculators_model_type): EAGLE-3.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# speculators' method -> vLLM's method, and whether k (benchmark.num_speculative_tokens) applies.
SERVED_AS = {
    "eagle3": ("eagle3", True),
    "peagle": ("eagle3", False),
    "dflash": ("dflash", False),
    "dflash2": ("dflash", False),
    "dspark": ("dspark", False),
}


def serving_config(draft_config: dict[str, Any], k: int) -> dict[str, Any]:
    """{"method", "num_speculative_tokens"[, "parallel_drafting"]} for a draft's config.json. Pure."""
    kind = draft_config.get("speculators_model_type", "eagle3")
    if kind not in SERVED_AS:
        raise ValueError(f"a {kind!r} draft: eagleflow serves {', '.join(SERVED_AS)}")
    method, takes_k = SERVED_AS[kind]
    if takes_k:
        tokens = k
    else:
        proposals = draft_config["speculators_config"]["proposal_methods"]
        tokens = int(proposals[0]["speculative_tokens"])
    out = {"method": method, "num_speculative_tokens": tokens}
    if kind == "peagle":
        out["parallel_drafting"] = True
    return out


def draft_method_name(draft_config: dict[str, Any]) -> str:
    """The draft's method as speculators names it (train.method). Pure."""
    return draft_config.get("speculators_model_type", "eagle3")


def read_draft_config(draft_dir: str) -> dict[str, Any]:
    """The exported draft's config.json."""
    return json.loads((Path(draft_dir) / "config.json").read_text())


def speculative_config(draft_dir: str, draft_config: dict[str, Any], k: int) -> dict[str, Any]:
    """vLLM's --speculative-config for the draft in `draft_dir` (its config.json: `draft_config`)."""
    return {**serving_config(draft_config, k), "model": str(Path(draft_dir).resolve())}
