"""The keys of the hidden states kept per sample (the store: runtime.state_store).

A sample's states are extracted once. Its key covers what shapes their bytes: the extraction's
settings key (the verifier by content, the settings, server flags, layers, code and software
that compute them: hidden_states.run.content_settings) and the sample's own tokens and loss
mask. Not its id or split: the same conversation under another id, or moved from train to
eval, has the same states. So a grown dataset extracts its new samples only, a fix that
changes k samples extracts those k, and a sample already stored never reaches the verifier
again.

Which extraction job (part) a sample belongs to is a stable hash of its id (part_of).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any

from eagleflow.common.fingerprint import stable_fraction

# The bucket seed of part_of: fixed, so that a sample stays in its part as the data grows.
PART_SEED = 1


def settings_key(settings: dict[str, Any], verifier_fingerprint: str) -> str:
    """The part of every sample key that the extraction decides: `settings` (what shapes the
    bytes: hidden_states.run.content_settings) and the verifier's content fingerprint. Pure."""
    digest = hashlib.sha256()
    digest.update(json.dumps(settings, sort_keys=True, default=str).encode())
    digest.update(verifier_fingerprint.encode())
    return digest.hexdigest()[:32]


def sample_key(settings: str, input_ids: Iterable[int], loss_mask: Iterable[int]) -> str:
    """A sample's key: the extraction's `settings` (settings_key) and the sample's tokens and
    loss mask, as int64 bytes (the plan keys 30,000 samples from numpy slices in seconds:
    dag.plan.tokens.Tokens.stored_samples). Pure."""
    import numpy as np

    digest = hashlib.sha256(settings.encode())
    for values in (input_ids, loss_mask):
        data = np.asarray(values, dtype=np.int64)
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data.tobytes())
    return digest.hexdigest()[:32]


def part_of(sample_id: str, num_parts: int) -> int:
    """Which of `num_parts` extraction jobs a sample belongs to: a stable hash of its id, so
    that an added sample joins one part and moves no other. Pure."""
    return min(int(stable_fraction(PART_SEED, sample_id) * num_parts), num_parts - 1)
