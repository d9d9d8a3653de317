"""`generate/replies.parquet`, the contract between the generate and synth stages: one row
per assistant turn with the request as sent and the reply body as received (or the error
that ended the conversation), bodies kept verbatim as JSON text."""

from __future__ import annotations

import json
import os
from typing import Any


def write_replies(path: str | os.PathLike, rows: list[dict[str, Any]]) -> None:
    """Write the rows (request and response as dicts) atomically, bodies as JSON text."""
    import pyarrow as pa

    from workflow_scripts.common.atomic import write_parquet

    schema = pa.schema(
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
    dump = lambda v: None if v is None else json.dumps(v, ensure_ascii=False)  # noqa: E731
    table = pa.Table.from_pylist(
        [{**r, "request": dump(r["request"]), "response": dump(r["response"])} for r in rows], schema=schema
    )
    write_parquet(path, table)


def read_replies(path: str | os.PathLike) -> list[dict[str, Any]]:
    """replies.parquet back as rows with `request` and `response` decoded."""
    import pyarrow.parquet as pq

    rows = pq.read_table(path).to_pylist()
    for r in rows:
        r["request"] = json.loads(r["request"])
        r["response"] = None if r["response"] is None else json.loads(r["response"])
    return rows
