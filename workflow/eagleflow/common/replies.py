"""`generate/replies.parquet`, the contract between the generate and synth stages: one row
per assistant turn with the request as sent and the reply body as received (or the error
that ended the conversation), bodies kept verbatim as JSON text."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any


def replies_schema():
    """The columns of replies.parquet (pyarrow)."""
    import pyarrow as pa

    return pa.schema(
        [
            ("id", pa.string()),
            ("prompt_id", pa.string()),
            ("turn", pa.int32()),
            ("category", pa.string()),
            ("key", pa.string()),
            ("request", pa.string()),
            ("response", pa.string()),
            ("error", pa.string()),
            ("attempts", pa.int32()),
        ]
    )


def write_replies(path: str | os.PathLike, rows: list[dict[str, Any]]) -> None:
    """Write the rows (request and response as dicts) atomically, bodies as JSON text."""
    import pyarrow as pa

    from eagleflow.common.atomic import write_parquet

    dump = lambda v: None if v is None else json.dumps(v, ensure_ascii=False)  # noqa: E731
    table = pa.Table.from_pylist(
        [{**r, "request": dump(r["request"]), "response": dump(r["response"])} for r in rows], schema=replies_schema()
    )
    # Small row groups: the join and synth read a shard's replies a row group at a time.
    write_parquet(path, table, row_group_size=1024)


def read_replies(path: str | os.PathLike) -> list[dict[str, Any]]:
    """replies.parquet back as rows with `request` and `response` decoded."""
    return list(iter_replies(path))


def iter_replies(path: str | os.PathLike, batch_rows: int = 1024) -> Iterator[dict[str, Any]]:
    """The rows of replies.parquet in order, decoded, `batch_rows` at a time in memory."""
    import pyarrow.parquet as pq

    for batch in pq.ParquetFile(path).iter_batches(batch_size=batch_rows):
        for r in batch.to_pylist():
            r["request"] = json.loads(r["request"])
            r["response"] = None if r["response"] is None else json.loads(r["response"])
            yield r
