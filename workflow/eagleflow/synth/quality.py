"""Quality accounting for synth output: defect counts, fractions and examples, taken one
sample at a time (`Quality.add`), so that synth holds no sample longer than its batch."""

from __future__ import annotations

import hashlib
from collections import Counter
from typing import Any

from eagleflow.common.defects import DEFECTS

EXAMPLES = 5


class Quality:
    """The quality report of the samples `add` was given, in order. `add` marks a repeat of an
    id, or of an identical token stream, after its first occurrence as a `duplicate` (streams
    are remembered by digest: 16 bytes each, whatever their length)."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()
        self.examples: dict[str, list[str]] = {}
        self.samples = 0
        self._ids: set[str] = set()
        self._streams: set[bytes] = set()

    def add(self, sample: dict[str, Any]) -> None:
        stream = _digest(sample["prompt_token_ids"], sample["completion_token_ids"])
        repeated = sample["id"] in self._ids or (sample["completion_token_ids"] and stream in self._streams)
        if repeated and "duplicate" not in sample["defects"]:
            sample["defects"] = [*sample["defects"], "duplicate"]
        self._ids.add(sample["id"])
        self._streams.add(stream)
        self.samples += 1
        for d in sample["defects"]:
            self.counts[d] += 1
            if len(self.examples.setdefault(d, [])) < EXAMPLES:
                self.examples[d].append(sample["id"])

    def report(self, errors: list[dict[str, Any]], num_prompts: int) -> dict[str, Any]:
        n = self.samples
        return {
            "num_prompts": num_prompts,
            "num_samples": n,
            "request_errors": len(errors),
            "request_error_fraction": len(errors) / max(num_prompts, 1),
            "counts": {d: self.counts.get(d, 0) for d in DEFECTS},
            "fractions": {d: self.counts.get(d, 0) / max(n, 1) for d in DEFECTS},
            "examples": self.examples,
            "error_examples": [e["conversation_id"] for e in errors[:EXAMPLES]],
        }


def _digest(prompt_ids, completion_ids) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(repr(list(prompt_ids or ())).encode())
    h.update(b"|")
    h.update(repr(list(completion_ids or ())).encode())
    return h.digest()


def quality_report(samples: list[dict[str, Any]], errors: list[dict[str, Any]], num_prompts: int) -> dict[str, Any]:
    """The report of a whole list of samples (marking their duplicates in place)."""
    quality = Quality()
    for s in samples:
        quality.add(s)
    return quality.report(errors, num_prompts)
