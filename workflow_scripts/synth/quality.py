"""Pure quality accounting for synth output: defect counts, fractions and examples."""

from __future__ import annotations

from collections import Counter
from typing import Any

from workflow_scripts.common.defects import DEFECTS


def mark_duplicates(samples: list[dict[str, Any]]) -> None:
    """Flag every repeat of an (id) or of an identical token stream after its first occurrence."""
    seen_ids, seen_streams = set(), set()
    for s in samples:
        stream = (tuple(s["prompt_token_ids"] or ()), tuple(s["completion_token_ids"] or ()))
        repeated = s["id"] in seen_ids or (s["completion_token_ids"] and stream in seen_streams)
        if repeated and "duplicate" not in s["defects"]:
            s["defects"] = [*s["defects"], "duplicate"]
        seen_ids.add(s["id"])
        seen_streams.add(stream)


def quality_report(samples: list[dict[str, Any]], errors: list[dict[str, Any]], num_prompts: int) -> dict[str, Any]:
    mark_duplicates(samples)
    counts = Counter(d for s in samples for d in s["defects"])
    n = len(samples)
    examples: dict[str, list[str]] = {}
    for s in samples:
        for d in s["defects"]:
            if len(examples.setdefault(d, [])) < 5:
                examples[d].append(s["id"])
    return {
        "num_prompts": num_prompts,
        "num_samples": n,
        "request_errors": len(errors),
        "request_error_fraction": len(errors) / max(num_prompts, 1),
        "counts": {d: counts.get(d, 0) for d in DEFECTS},
        "fractions": {d: counts.get(d, 0) / max(n, 1) for d in DEFECTS},
        "examples": examples,
        "error_examples": [e["conversation_id"] for e in errors[:5]],
    }
