"""Which samples an extraction part holds, the disk check before states are written, and
index.json over all samples (the file format itself: hidden_states.shard_file; the store:
runtime.state_store; the keys: hidden_states.sample_keys)."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from eagleflow.common.atomic import write_json
from eagleflow.hidden_states.layers import CONVENTION, vllm_layer_ids
from eagleflow.hidden_states.sample_keys import part_of
from eagleflow.hidden_states.shard_file import read_shard_header, shard_content_digest, shard_samples
from eagleflow.hidden_states.storage import FP8, shard_bytes
from eagleflow.runtime.smk import stage
from eagleflow.runtime.state_store import STORE_DIR, relative_path

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


def samples_for_part(train: str, eval_: str, part: int, num_parts: int) -> list[dict[str, Any]]:
    """The dataset's samples of extraction part `part` (sample_keys.part_of), in id order."""
    rows = []
    for split, path in (("train", train), ("eval", eval_)):
        for r in pq.read_table(path, columns=["id", "input_ids", "loss_mask"]).to_pylist():
            if part_of(r["id"], num_parts) == part:
                rows.append({**r, "split": split})
    rows.sort(key=lambda r: r["id"])
    return rows


def main(smk) -> None:
    """The hidden_states_index rule's job (workflow/rules/hidden_states.smk)."""
    with stage(smk):
        write_index_of_parts(list(smk.input.parts), smk.input.verifier, smk.output.index, smk.output.stats)


# Layout fields every part (and every shard) of one index must agree on.
LAYOUT = ("aux_layer_ids", "num_layers", "hidden_size", "dtype", "target_topk")


def check_layout(headers: list[dict[str, Any]], what: str) -> None:
    first = headers[0]
    for h in headers[1:]:
        for key in LAYOUT:
            if h[key] != first[key]:
                raise ValueError(
                    f"{what} {h['path']} has {key}={h[key]}, {what} {first['path']} has {first[key]}: "
                    f"rerun the stale {what}"
                )


def index_document(
    verifier_dir: str, layout: dict[str, Any], backends: list[str], samples: list[dict[str, Any]]
) -> dict[str, Any]:
    """index.json (docs/data-contracts.md): the layout training reads and one entry per sample,
    {id, split, num_tokens, file (relative to the index), row (the sample's place in the file),
    digest (of what the file holds for it)}, in id order. Pure."""
    samples = sorted(samples, key=lambda s: (s["id"], s["split"]))
    return {
        "verifier": verifier_dir,
        "aux_layer_ids": layout["aux_layer_ids"],
        "final_layer_id": layout["num_layers"],
        "vllm_layer_ids": vllm_layer_ids(layout["aux_layer_ids"], layout["num_layers"]),
        "num_layers": layout["num_layers"],
        "hidden_size": layout["hidden_size"],
        "dtype": layout["dtype"],
        "target_topk": layout["target_topk"],  # 0: the files keep the final state
        "backends": sorted(set(backends)),
        "convention": CONVENTION,
        "num_samples": len(samples),
        "num_tokens": sum(s["num_tokens"] for s in samples),
        "samples": samples,
    }


def write_index_of_parts(parts: list[str], verifier_dir: str, out: str, stats_out: str | None = None) -> dict[str, Any]:
    """index.json over the extraction parts' manifests (hidden_states.run), whose samples are in
    the store beside it, and stats.json: what the phase extracted and what it found stored."""
    manifests = [{**json.loads(Path(p).read_text()), "path": Path(p).name} for p in parts]
    with_samples = [m for m in manifests if m["samples"]]
    if not with_samples:
        raise ValueError(f"{', '.join(parts)}: no samples to index (is the dataset empty?)")
    for m in with_samples:
        # The store keeps the dtype as safetensors names it (read_shard_header's), as shards did.
        m["dtype"] = read_shard_header(str(Path(out).parent / STORE_DIR / relative_path(m["samples"][0]["key"])))[
            "dtype"
        ]
    check_layout(with_samples, "part")
    entries = [
        {
            **{k: s[k] for k in ("id", "split", "num_tokens", "key", "digest")},
            "file": f"{STORE_DIR}/{relative_path(s['key'])}",
            "row": 0,
        }
        for m in manifests
        for s in m["samples"]
    ]
    doc = index_document(verifier_dir, with_samples[0], [m["backend"] for m in with_samples], entries)
    write_json(out, doc)
    if stats_out:
        total = {k: sum(m["stats"][k] for m in manifests) for k in manifests[0]["stats"] if k != "wall_s"}
        write_json(stats_out, {**total, "parts": [{"part": m["part"], **m["stats"]} for m in manifests]})
    return doc


def write_index(shards: list[str], verifier_dir: str, out: str) -> dict[str, Any]:
    """index.json over shard files of several samples each (tests and benchmarks write those:
    devkit.train_inputs), in the same format as write_index_of_parts'."""
    headers = [read_shard_header(s) for s in shards]
    check_layout(headers, "shard")
    base = Path(out).parent.resolve()
    entries = []
    for path in shards:
        digest = shard_content_digest(path)
        rel = os.path.relpath(Path(path).resolve(), base)
        for row, (sample_id, n, is_eval) in enumerate(shard_samples(path)):
            entries.append(
                {
                    "id": sample_id,
                    "split": "eval" if is_eval else "train",
                    "num_tokens": n,
                    "digest": f"{digest}:{row}",
                    "file": rel,
                    "row": row,
                }
            )
    doc = index_document(verifier_dir, headers[0], [h["backend"] for h in headers], entries)
    write_json(out, doc)
    return doc
