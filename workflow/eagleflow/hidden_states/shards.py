"""Which samples go to a shard, a shard's cache key, the disk check before a shard is
written, and index.json over all shards (the file format itself: hidden_states.shard_file)."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from eagleflow.common.atomic import write_json
from eagleflow.common.identity import verifier_fingerprint
from eagleflow.hidden_states.layers import CONVENTION, vllm_layer_ids
from eagleflow.hidden_states.shard_file import read_shard_header
from eagleflow.hidden_states.storage import FP8, shard_bytes
from eagleflow.runtime.shared_server import stop_idle_shared_servers
from eagleflow.runtime.smk import stage

log = logging.getLogger(__name__)


def check_disk_space(
    out_dir: Path, num_tokens: int, num_samples: int, num_states: int, hidden_size: int, storage: str, topk: int = 0
) -> int:
    """Log what the shard will take and refuse to start when the target disk lacks room."""
    need = shard_bytes(num_tokens, num_samples, num_states, hidden_size, storage, topk)
    out_dir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out_dir).free
    log.info(
        "will write %d bytes (%.2f GB: %d tokens x %d states x %d hidden in %s%s); %d bytes free on %s",
        need,
        need / 1e9,
        num_tokens,
        num_states,
        hidden_size,
        storage,
        f", top-{topk} logits" if topk else "",
        free,
        out_dir,
    )
    if need > free:
        smaller = "" if storage == FP8 else f", or store in {FP8} (hidden_states.dtype, half of bfloat16)"
        raise OSError(
            f"{out_dir}: the hidden states need {need} bytes ({need / 1e9:.2f} GB) but only {free} bytes "
            f"({free / 1e9:.2f} GB) are free: free space, raise hidden_states.num_shards "
            f"(shards are written one at a time per job){smaller}, or train without shards "
            "(hidden_states.mode: online); `python -m eagleflow.plan` shows the whole run's needs"
        )
    return need


def shard_key(samples: list[dict[str, Any]], verifier_dir: str, settings: dict[str, Any]) -> str:
    """What a shard is made from: its samples (ids, tokens, loss masks), the verifier's files
    by content (common.identity: the same files at another path are the same verifier) and the
    settings that change its bytes (`settings`). Pure but for reading the verifier's files."""
    digest = hashlib.sha256()
    digest.update(json.dumps(settings, sort_keys=True, default=str).encode())
    digest.update(verifier_fingerprint(verifier_dir).encode())
    for s in samples:
        digest.update(json.dumps([s["id"], s["split"], list(s["input_ids"]), list(s["loss_mask"])]).encode())
    return digest.hexdigest()[:16]


def samples_for_shard(train: str, eval_: str, shard: int, num_shards: int) -> list[dict[str, Any]]:
    rows = []
    for split, path in (("train", train), ("eval", eval_)):
        for r in pq.read_table(path, columns=["id", "input_ids", "loss_mask"]).to_pylist():
            rows.append({**r, "split": split})
    rows.sort(key=lambda r: r["id"])
    return rows[shard::num_shards]


def main(smk) -> None:
    """The hidden_states_index rule's job (workflow/rules/hidden_states.smk)."""
    with stage(smk):
        write_index(list(smk.input.shards), smk.input.verifier, smk.output[0])
        # Every shard is written: the phase's server has no job left to serve, and its GPUs
        # are free for the next stage now rather than after hidden_states.linger_s.
        stop_idle_shared_servers(Path(smk.log[0]).parent / "servers", "hidden_states")


def write_index(shards: list[str], verifier_dir: str, out: str) -> None:
    headers = [read_shard_header(s) for s in shards]
    first = headers[0]
    for h in headers[1:]:
        for key in ("aux_layer_ids", "num_layers", "hidden_size", "dtype", "target_topk"):
            if h[key] != first[key]:
                raise ValueError(
                    f"shard {h['path']} has {key}={h[key]}, shard "
                    f"{first['path']} has {first[key]}: rerun the stale shard"
                )
    write_json(
        out,
        {
            "verifier": verifier_dir,
            "aux_layer_ids": first["aux_layer_ids"],
            "final_layer_id": first["num_layers"],
            "vllm_layer_ids": vllm_layer_ids(first["aux_layer_ids"], first["num_layers"]),
            "num_layers": first["num_layers"],
            "hidden_size": first["hidden_size"],
            "dtype": first["dtype"],
            "target_topk": first["target_topk"],  # 0: shards keep the final state
            "backends": sorted({h["backend"] for h in headers}),
            "convention": CONVENTION,
            "num_samples": sum(h["num_samples"] for h in headers),
            "num_tokens": sum(h["num_tokens"] for h in headers),
            "shards": headers,
        },
    )
