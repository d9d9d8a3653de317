"""The shard file: its one writer, and its tensor and metadata names.

A shard holds the states and tokens of its samples back to back, unpadded, in one safetensors
file written atomically (docs/data-contracts.md): the aux states (`hidden_states`), the final
state (`verifier_last_hidden_states`) or, with the compact target, the verifier's top-k ids
and logits (`target_ids`, `target_logits`), fp8 scales beside fp8 states (`<name>_scale`),
the tokens (`input_ids`), the loss mask, each sample's offset and split; its metadata names
the samples, the layer ids and the verifier's geometry. Imports no extraction code. Shards
are read by hidden_states/shard_reader.py, outside the extraction's code: editing the reader
restales training, never the shards.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagleflow.common.atomic import write_safetensors
from eagleflow.hidden_states.layers import CONVENTION, States
from eagleflow.hidden_states.storage import FP8, quantize_fp8

# Tensor names.
AUX = "hidden_states"
FINAL = "verifier_last_hidden_states"
TARGET_IDS = "target_ids"
TARGET_LOGITS = "target_logits"
INPUT_IDS = "input_ids"
LOSS_MASK = "loss_mask"
OFFSETS = "offsets"
IS_EVAL = "is_eval"


@dataclass(frozen=True)
class ShardMeta:
    """A shard's metadata: its samples in order, the layers its states come from, the
    verifier's geometry, and the backend that extracted them."""

    sample_ids: list[str]
    aux_layer_ids: list[int]
    num_layers: int
    hidden_size: int
    backend: str = "hf"
    made_from: str = ""  # the shard cache's key: what the shard was made from (hidden_states.run)

    def as_metadata(self) -> dict[str, str]:
        return {
            "made_from": self.made_from,
            "sample_ids": json.dumps(self.sample_ids),
            "aux_layer_ids": json.dumps(self.aux_layer_ids),
            "final_layer_id": str(self.num_layers),  # the final state's layer (docs/data-contracts.md)
            "num_layers": str(self.num_layers),
            "hidden_size": str(self.hidden_size),
            "backend": self.backend,
            "convention": CONVENTION,
        }

    @classmethod
    def of(cls, metadata: dict[str, str]) -> ShardMeta:
        return cls(
            json.loads(metadata["sample_ids"]),
            json.loads(metadata["aux_layer_ids"]),
            int(metadata["num_layers"]),
            int(metadata["hidden_size"]),
            metadata.get("backend", "hf"),
            metadata.get("made_from", ""),
        )


def write_shard(
    path: str | os.PathLike,
    samples: list[dict[str, Any]],
    states: list[States],
    meta: ShardMeta,
    storage: str = "bfloat16",
    targets: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> None:
    """Write a shard of `samples` (dicts with id, split, input_ids, loss_mask) and their
    states atomically; with `targets` the compact target replaces the final state."""
    if meta.sample_ids != [s["id"] for s in samples]:
        raise ValueError(f"{path}: the metadata names other samples than the shard holds")
    tensors = shard_tensors(samples, states, storage, targets)
    metadata = meta.as_metadata()
    write_safetensors(path, tensors, {**metadata, CONTENT_DIGEST: content_digest_of(tensors, metadata)})


# The header field that holds the digest of what the shard holds (content_digest_of): training
# keys its drafts by it, so a re-extraction that writes the same states restores every draft.
CONTENT_DIGEST = "content_digest"
# Metadata that says where or how a shard was made, not what it holds: not in its digest.
PROVENANCE = frozenset({"made_from", "backend", CONTENT_DIGEST})


def content_digest_of(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> str:
    """sha256 of a shard's content: every tensor's name, dtype, shape and bytes, and the
    metadata that describes them (not PROVENANCE: the same states from the hf and the vllm
    backend, or made under another key, are the same shard). Pure."""
    h = hashlib.sha256()
    h.update(json.dumps({k: v for k, v in sorted(metadata.items()) if k not in PROVENANCE}).encode())
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"\0{name}\0{t.dtype}\0{list(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()[:32]


def shard_content_digest(path: str | os.PathLike, verify: bool = False) -> str:
    """The digest of what a shard holds: from its header, or (a shard written before headers
    carried it, or `verify`) computed from its tensors. With `verify`, a header that no longer
    matches the tensors (the file was edited in place) is an error."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
        recorded = metadata.get(CONTENT_DIGEST, "")
        if recorded and not verify:
            return recorded
        computed = content_digest_of({k: f.get_tensor(k) for k in f.keys()}, metadata)  # noqa: SIM118
    if recorded and recorded != computed:
        raise ValueError(
            f"{path}: its tensors no longer match the digest in its header (edited in place?): "
            "delete it and rerun its hidden_states job"
        )
    return computed


def shard_tensors(
    samples: list[dict[str, Any]],
    states: list[States],
    storage: str = "bfloat16",
    targets: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> dict[str, torch.Tensor]:
    """The shard's tensors: states and tokens of all samples back to back, unpadded, the states
    in `storage` (fp8 with a scale per token and state). With `targets` (the compact target,
    hidden_states/targets.py: each sample's top-k ids and logits) they replace the final state. Pure."""
    offsets = [0]
    for s, (aux, final) in zip(samples, states, strict=True):
        n = len(s["input_ids"])
        if aux.shape[0] != n or final.shape[0] != n:
            raise ValueError(f"sample {s['id']}: {n} tokens but states for {aux.shape[0]} / {final.shape[0]}")
        offsets.append(offsets[-1] + n)
    aux = torch.cat([a for a, _ in states])
    hidden_size = states[0][1].shape[1]
    scales = {}
    if storage == FP8:
        aux, scales[f"{AUX}_scale"] = quantize_fp8(aux, aux.shape[1] // hidden_size)
    if targets is None:
        final = torch.cat([f for _, f in states])
        if storage == FP8:
            final, scales[f"{FINAL}_scale"] = quantize_fp8(final, 1)
        target = {FINAL: final}
    else:
        target = {TARGET_IDS: torch.cat([i for i, _ in targets]), TARGET_LOGITS: torch.cat([v for _, v in targets])}
    return {
        AUX: aux,
        **target,
        **scales,
        INPUT_IDS: torch.tensor([t for s in samples for t in s["input_ids"]], dtype=torch.int32),
        LOSS_MASK: torch.tensor([t for s in samples for t in s["loss_mask"]], dtype=torch.int8),
        OFFSETS: torch.tensor(offsets, dtype=torch.int64),
        IS_EVAL: torch.tensor([s["split"] == "eval" for s in samples], dtype=torch.bool),
    }


def shard_samples(path: str | os.PathLike) -> list[tuple[str, int, bool]]:
    """(id, tokens, is eval) of each sample a shard holds, in order: read from its header and
    its small tensors."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        ids = json.loads((f.metadata() or {})["sample_ids"])
        offsets = f.get_tensor(OFFSETS).tolist()
        is_eval = [bool(x) for x in f.get_tensor(IS_EVAL).tolist()]
    return [(i, offsets[k + 1] - offsets[k], is_eval[k]) for k, i in enumerate(ids)]


def read_shard_header(path: str) -> dict[str, Any]:
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
        return {
            "path": Path(path).name,
            "num_samples": len(json.loads(meta["sample_ids"])),
            "num_tokens": f.get_slice(INPUT_IDS).get_shape()[0],
            "aux_layer_ids": json.loads(meta["aux_layer_ids"]),
            "num_layers": int(meta["num_layers"]),
            "hidden_size": int(meta["hidden_size"]),
            "dtype": str(f.get_slice(AUX).get_dtype()),
            "target_topk": f.get_slice(TARGET_IDS).get_shape()[1] if TARGET_IDS in f.keys() else 0,  # noqa: SIM118
            "backend": meta.get("backend", "hf"),
        }
