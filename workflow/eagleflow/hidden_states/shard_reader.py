"""Reading hidden-state shards (hidden_states/shard_file.py names what they hold): sample by
sample from the memory-mapped file, so that training holds one batch's states, not a run's.

Not imported by extraction: the shard jobs' code fingerprint, which keys every shard, does not
include it, so a change here restales training, never the shards.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from eagleflow.hidden_states.shard_file import (
    AUX,
    FINAL,
    INPUT_IDS,
    IS_EVAL,
    LOSS_MASK,
    OFFSETS,
    TARGET_IDS,
    TARGET_LOGITS,
    ShardMeta,
)
from eagleflow.hidden_states.storage import stored_states


@dataclass(frozen=True)
class ShardSample:
    """One sample of a shard as training reads it: tokens and loss mask, the aux states and
    either the final state or the compact target's top-k (verifier-vocabulary) ids and logits,
    states in the dtype asked for (fp8 dequantized)."""

    id: str
    is_eval: bool
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    aux: torch.Tensor
    final: torch.Tensor | None
    target_ids: torch.Tensor | None
    target_logits: torch.Tensor | None


class ShardReader:
    """One shard, open for reading sample by sample. Opening reads its metadata, offsets and
    splits; a sample's tokens, mask and states are read when asked for, as slices of the
    memory-mapped file, so that a reader holds no states of its own (training reads each batch
    this way: the shards of a large run do not fit in host memory). Bad files are a ValueError
    that names the shard."""

    def __init__(self, path: str | os.PathLike):
        from safetensors import SafetensorError, safe_open

        self.path = str(path)
        try:
            self._file = safe_open(self.path, framework="pt")
            self.meta = ShardMeta.of(self._file.metadata() or {})
            self._names = set(self._file.keys())
            self.offsets: list[int] = self._file.get_tensor(OFFSETS).tolist()
            self.is_eval: list[bool] = [bool(x) for x in self._file.get_tensor(IS_EVAL).tolist()]
        except (OSError, KeyError, ValueError, SafetensorError) as e:
            raise ValueError(
                f"{path}: not a readable hidden-state shard ({type(e).__name__}: {e}); "
                "delete it and rerun its hidden_states job"
            ) from e
        if len(self.offsets) != len(self.meta.sample_ids) + 1 or len(self.is_eval) != len(self.meta.sample_ids):
            raise ValueError(f"{path}: {len(self.meta.sample_ids)} samples named but {len(self.offsets) - 1} stored")
        # The compact target (hidden_states.target: topk) keeps top-k logits instead of the final state.
        self.compact = FINAL not in self._names

    def __len__(self) -> int:
        return len(self.meta.sample_ids)

    def num_tokens(self, i: int) -> int:
        return self.offsets[i + 1] - self.offsets[i]

    def sample(self, i: int, dtype: torch.dtype = torch.float32) -> ShardSample:
        """Sample `i`, states in `dtype` (fp8 dequantized): read from the file now."""
        a, b = self.offsets[i], self.offsets[i + 1]
        t = {name: self._file.get_slice(name)[a:b] for name in self._names - {OFFSETS, IS_EVAL}}
        return ShardSample(
            self.meta.sample_ids[i],
            self.is_eval[i],
            t[INPUT_IDS].long(),
            t[LOSS_MASK].bool(),
            stored_states(t, AUX, dtype),
            None if self.compact else stored_states(t, FINAL, dtype),
            t[TARGET_IDS].long() if self.compact else None,
            t[TARGET_LOGITS].float() if self.compact else None,
        )


def read_shard(path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> tuple[ShardMeta, list[ShardSample]]:
    """A shard's metadata and all its samples, states in `dtype`."""
    reader = ShardReader(path)
    return reader.meta, [reader.sample(i, dtype) for i in range(len(reader))]


def indexed_entries(doc_path: str | os.PathLike) -> tuple[dict, list[tuple[str, int, dict]]]:
    """(the document, [(file, row, entry)] for every sample it names, in its order): an
    index.json names each sample's file relative to itself and its row there; an extraction
    part's manifest names its samples by key, in the store beside it."""
    import json
    from pathlib import Path

    from eagleflow.runtime.state_store import STORE_DIR, relative_path

    doc = json.loads(Path(doc_path).read_text())
    if "samples" not in doc:
        raise ValueError(
            f"{doc_path}: an index without per-sample entries (written before 2026-12-05): rerun hidden_states_index"
        )
    base = Path(doc_path).parent
    return doc, [
        (
            # A sample in a bucket is named by its URL (runtime.object_store).
            s["file"]
            if s.get("file", "").startswith("s3://")
            else str(base / s["file"])
            if "file" in s
            else str(base / STORE_DIR / relative_path(s["key"])),
            int(s.get("row", 0)),
            s,
        )
        for s in doc["samples"]
    ]


def read_indexed(doc_path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> list[ShardSample]:
    """Every sample an index.json or an extraction part's manifest names, in its order, under
    the id and split the document gives (a stored sample's file names it by its content)."""
    import dataclasses

    return [
        dataclasses.replace(ShardReader(file).sample(row, dtype), id=s["id"], is_eval=s["split"] == "eval")
        for file, row, s in indexed_entries(doc_path)[1]
    ]
