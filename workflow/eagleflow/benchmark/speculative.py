"""vLLM's speculative config for an exported draft: how its method is served (the benchmark
rule's `serving` param, the method's Serving in train/methods/), with the number of draft tokens
set where the method lets a deployment choose it, as vLLM reads a speculators checkpoint
(SpeculatorsConfig.build_vllm_speculative_config).

- A chain (EAGLE-3) proposes any length up to what serving can afford:
  `benchmark.num_speculative_tokens` (k) sets it, whatever training's ttt_steps was.
- A parallel or block drafter (P-EAGLE, the DFlash family) drafts its trained length in one
  forward: the checkpoint's greedy proposal holds it, and k does not apply.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def serving_config(draft_config: dict[str, Any], serving: dict[str, Any], k: int) -> dict[str, Any]:
    """{"method", "num_speculative_tokens"[, "parallel_drafting"]} for a draft's config.json,
    served as `serving` ({"method": train.method, and its Serving's fields}) says. Pure."""
    trained = draft_config.get("speculators_model_type")  # none in vLLM's own format
    if trained is not None and trained != serving["method"]:
        raise ValueError(f"the draft is a {trained} draft (its config.json); train.method is {serving['method']}")
    if serving["takes_k"]:
        tokens = k
    else:
        proposals = draft_config["speculators_config"]["proposal_methods"]
        tokens = int(proposals[0]["speculative_tokens"])
    out = {"method": serving["vllm_method"], "num_speculative_tokens": tokens}
    if serving["parallel_drafting"]:
        out["parallel_drafting"] = True
    return out


def read_draft_config(draft_dir: str) -> dict[str, Any]:
    """The exported draft's config.json."""
    return json.loads((Path(draft_dir) / "config.json").read_text())


def speculative_config(draft_dir: str, draft_config: dict[str, Any], serving: dict[str, Any], k: int) -> dict[str, Any]:
    """vLLM's --speculative-config for the draft in `draft_dir` (its config.json: `draft_config`)."""
    return {**serving_config(draft_config, serving, k), "model": str(Path(draft_dir).resolve())}
