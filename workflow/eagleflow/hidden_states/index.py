"""index.json over the extraction jobs' manifests (or over shard files of many samples, as
tests and benchmarks write them), and stats.json: the hidden_states_index rule's job. Not
imported by the extraction jobs: an edit here re-extracts nothing (the stored samples' keys
hold the extraction's code fingerprint, not this module's)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from eagleflow.common.atomic import write_json
from eagleflow.hidden_states.layers import CONVENTION, vllm_layer_ids
from eagleflow.hidden_states.shard_file import read_shard_header, shard_content_digest, shard_samples
from eagleflow.runtime.smk import stage
from eagleflow.runtime.state_store import STORE_DIR, BucketSampleStore, relative_path


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
    stores = {m.get("store") for m in manifests}
    if len(stores) > 1:
        raise ValueError(
            f"{', '.join(parts)}: the parts' samples lie in different stores ({sorted(map(str, stores))}): "
            "rerun the parts whose store is not storage.states's (snakemake --forcerun hidden_states)"
        )
    (store,) = stores
    for m in with_samples:
        # The store keeps the dtype as safetensors names it (read_shard_header's), as shards did.
        key = m["samples"][0]["key"]
        if store:
            bucket = BucketSampleStore(store)
            try:
                m["dtype"] = read_shard_header(str(bucket.header_file(key)))["dtype"]
            finally:
                bucket.close()
        else:
            m["dtype"] = read_shard_header(str(Path(out).parent / STORE_DIR / relative_path(key)))["dtype"]
    check_layout(with_samples, "part")
    entries = [
        {
            **{k: s[k] for k in ("id", "split", "num_tokens", "key", "digest")},
            # Relative to the index, or the sample's URL in a bucket.
            "file": f"{store}/{relative_path(s['key'])}" if store else f"{STORE_DIR}/{relative_path(s['key'])}",
            "row": 0,
        }
        for m in manifests
        for s in m["samples"]
    ]
    doc = index_document(verifier_dir, with_samples[0], [m["backend"] for m in with_samples], entries)
    if store:
        doc["store"] = store
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
