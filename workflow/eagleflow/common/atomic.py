"""Atomic writes: a reader (or a restarted job) never sees a half-written file.

Every stage writes through these helpers: the bytes go to a temporary file in the same
directory, are fsynced, then renamed over the target, which POSIX makes atomic.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to `target`; rename it onto `target` on success.

    Works for files and directories: whatever the caller creates at the yielded path
    replaces `target` as a whole. On an exception the temporary is removed and `target`
    is left as it was.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    tmp_target = tmp / target.name
    try:
        yield tmp_target
        if tmp_target.is_file():
            with open(tmp_target, "rb") as fh:
                os.fsync(fh.fileno())
        if target.is_dir() and not target.is_symlink():
            # rename() cannot replace a non-empty directory: move the old one aside first.
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
            os.replace(target, old / target.name)
            os.replace(tmp_target, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp_target, target)
        _fsync_dir(target.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_json(path: str | os.PathLike, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n")


def write_jsonl(path: str | os.PathLike, rows: list[dict[str, Any]]) -> None:
    write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def write_parquet(path: str | os.PathLike, table, row_group_size: int | None = None) -> None:
    """Write a pyarrow Table (or pandas DataFrame) atomically; `row_group_size` rows per row
    group (pyarrow's default: up to a million), which is what a streaming reader holds at once."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not isinstance(table, pa.Table):
        table = pa.Table.from_pandas(table, preserve_index=False)
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, row_group_size=row_group_size)


class ParquetRows:
    """Rows (dicts) into one Parquet file, `batch_rows` at a time: a row group per batch, and
    never more than a batch in memory. `rows`: how many were given, the batch not yet
    written included."""

    def __init__(self, writer, schema, batch_rows: int):
        self._writer, self._schema, self._batch_rows = writer, schema, batch_rows
        self._batch: list[dict[str, Any]] = []
        self.rows = 0

    def write(self, row: dict[str, Any]) -> None:
        self._batch.append(row)
        self.rows += 1
        if len(self._batch) == self._batch_rows:
            self.flush()

    def flush(self) -> None:
        import pyarrow as pa

        if self._batch:
            self._writer.write_table(pa.Table.from_pylist(self._batch, schema=self._schema))
            self._batch = []


@contextlib.contextmanager
def parquet_rows(path: str | os.PathLike, schema, batch_rows: int = 1024) -> Iterator[ParquetRows]:
    """Write rows to `path` as they come (ParquetRows); the file replaces `path` only when
    the block ends without an exception: a failure or a kill midway leaves `path` as it was."""
    import pyarrow.parquet as pq

    with atomic_path(path) as tmp, pq.ParquetWriter(tmp, schema) as writer:
        rows = ParquetRows(writer, schema, batch_rows)
        yield rows
        rows.flush()


def write_safetensors(path: str | os.PathLike, tensors: dict, metadata: dict[str, str] | None = None) -> None:
    from safetensors.torch import save_file

    with atomic_path(path) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "item"):
        return obj.item()
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"cannot serialise {type(obj).__name__} to JSON")
