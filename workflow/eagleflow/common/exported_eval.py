"""Reading the train stage's metrics rows (drafts/<id>/train/metrics.jsonl), for the stages
that report on a draft."""

from __future__ import annotations

from typing import Any


def exported_eval(metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """The eval row of the exported draft: the lowest eval loss (train.loop exports those
    weights); {} without eval rows. Pure."""
    evals = [m for m in metrics if m.get("split") == "eval"]
    return min(evals, key=lambda m: m["loss"]) if evals else {}
