"""The generate_join stage: the shards' replies as the one `replies.parquet` synth reads,
the same rows, request for request, in the same order, as one generate job would write, and
the shards' stats summed into one `stats.json`. Streamed: its memory is a few thousand rows
and the prompt ids, whatever the number of conversations."""

from __future__ import annotations

import heapq
import json
import logging
from collections.abc import Iterator
from pathlib import Path

from eagleflow.common.atomic import parquet_rows, read_jsonl, write_json
from eagleflow.runtime.smk import stage

log = logging.getLogger(__name__)


# Summed over the shards' stats; the rest are per shard only (`shards`).
SUMMED = ("conversations", "requests", "sent", "reused", "sent_tokens", "failed_conversations", "server_restarts")


def join_shards(
    prompts_path: str,
    replies_paths: list[str],
    stats_paths: list[str],
    replies_out: str,
    stats_out: str,
    batch_rows: int = 2048,
) -> None:
    """One replies.parquet from the shards', rows in the prompt file's order (each
    conversation's turns in order), as one job writes them; the shards' stats summed, and
    each kept. Each shard's rows are already in that order (a shard keeps the file's order
    of its conversations), so the join merges them as streams, `batch_rows` rows at a time,
    never a whole shard in memory, and never decodes a body. Refuses shards that miss a
    conversation, hold one twice, or hold one the prompt file does not."""
    import pyarrow.parquet as pq

    order = {p["id"]: i for i, p in enumerate(read_jsonl(prompts_path))}
    files = [pq.ParquetFile(path) for path in replies_paths]
    owner: dict[str, int] = {}
    merged = heapq.merge(*(_stream(f, k, order, replies_paths[k]) for k, f in enumerate(files)), key=lambda e: e[0])
    with parquet_rows(replies_out, files[0].schema_arrow, batch_rows) as out:
        for _, shard, row in merged:
            if (first := owner.setdefault(row["prompt_id"], shard)) != shard:
                raise ValueError(
                    f"conversation {row['prompt_id']} is in two shards' replies: "
                    f"{replies_paths[first]} and {replies_paths[shard]}"
                )
            out.write(row)
        missing = order.keys() - owner.keys()
        if missing:
            raise ValueError(f"{len(missing)} conversations are in no shard's replies (e.g. {sorted(missing)[:3]})")
    shards = [json.loads(Path(p).read_text()) for p in stats_paths]
    stats = {k: sum(s.get(k) or 0 for s in shards) for k in SUMMED}
    stats |= {
        # Replica-seconds: the plan's per-replica rate is sent_tokens / server_s.
        "server_s": round(sum(s.get("server_s") or 0 for s in shards), 3),
        "server_started": any(s.get("server_started") for s in shards),
        "store_entries": sum(s.get("store_entries") or 0 for s in shards),
        "store_entries_unused": sum(s.get("store_entries_unused") or 0 for s in shards),
        # The busiest shard's concurrency trace (the report plots one).
        "concurrency": max(shards, key=lambda s: s.get("sent") or 0, default={}).get("concurrency"),
        "wall_s": max((s.get("wall_s") or 0 for s in shards), default=0),
        "shards": shards,
    }
    write_json(stats_out, stats)
    log.info("joined %d shards: %d conversations, %d requests", len(shards), len(order), out.rows)


def _stream(file, shard: int, order: dict[str, int], path: str) -> Iterator[tuple[tuple[int, int], int, dict]]:
    """A shard's rows as ((position in the prompt file, turn), shard, row), checked in order."""
    last = (-1, -1)
    # A batch per shard is in memory at once (rows of several KB each): keep them small.
    for batch in file.iter_batches(batch_size=128):
        for row in batch.to_pylist():
            if row["prompt_id"] not in order:
                raise ValueError(f"{path}: conversation {row['prompt_id']} is not in the prompt file")
            key = (order[row["prompt_id"]], row["turn"])
            if key <= last:
                raise ValueError(f"{path}: rows are not in the prompt file's order at {row['id']}")
            last = key
            yield key, shard, row


def main(smk) -> None:
    """The generate_join rule's job (workflow/rules/generate.smk)."""
    with stage(smk):
        join_shards(smk.input.prompts, smk.input.replies, smk.input.stats, smk.output.replies, smk.output.stats)
