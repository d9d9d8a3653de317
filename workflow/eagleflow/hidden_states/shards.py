"""Which samples an extraction job holds, and the disk check before it writes their states
(the file format: hidden_states.shard_file; the store: runtime.state_store; the keys:
hidden_states.sample_keys; index.json: hidden_states.index)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from eagleflow.hidden_states.sample_keys import part_of
from eagleflow.hidden_states.storage import FP8, shard_bytes

log = logging.getLogger(__name__)


def check_disk_space(
    out_dir: Path, num_tokens: int, num_samples: int, num_states: int, hidden_size: int, storage: str, topk: int = 0
) -> int:
    """Log what the states will take and refuse to start when the target disk lacks room."""
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
            f"({free / 1e9:.2f} GB) are free: free space (`python -m eagleflow.runtime.output_cache prune` "
            f"drops stored states no index names){smaller}, or train without stored states "
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
