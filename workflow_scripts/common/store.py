"""The response store: every reply the verifier gave, keyed by its request.

SQLite in WAL mode (Python's stdlib): each reply is one committed transaction, synced to
disk before the next request is counted done, so a job killed at any instant (SIGKILL
included) loses at most the replies still in flight, never a stored one, and leaves no torn
record. Lookups are indexed; several readers may open the store while a job writes.

Entries are never dropped by a run: a key no current request uses (an old prompt, an older
sampling setting) stays until `python -m workflow_scripts.generate prune` removes it.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS replies (
    key TEXT PRIMARY KEY,
    request BLOB NOT NULL,
    response BLOB NOT NULL,
    created REAL NOT NULL
)
"""


class StoreError(RuntimeError):
    pass


def _pack(value: dict[str, Any]) -> bytes:
    # Replies are mostly token-id lists: zlib makes them 3-5x smaller at no noticeable cost.
    return zlib.compress(json.dumps(value, ensure_ascii=False).encode(), 3)


def _unpack(blob: bytes) -> dict[str, Any]:
    return json.loads(zlib.decompress(blob))


class ResponseStore:
    """Replies by request key. Use as a context manager (or call `close`)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._db = sqlite3.connect(self.path, timeout=60.0, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            # FULL: a commit is on disk when it returns, so a stored reply survives a crash.
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute(SCHEMA)
        except sqlite3.DatabaseError as exc:
            raise StoreError(
                f"response store {self.path} cannot be opened ({exc}). Move it aside to start an empty one "
                f"(every reply it held will be requested again), or point generate.store at another file."
            ) from exc

    def __enter__(self) -> ResponseStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._db.close()

    def __len__(self) -> int:
        return self._db.execute("SELECT COUNT(*) FROM replies").fetchone()[0]

    def get(self, key: str) -> dict[str, Any] | None:
        """The stored reply body for `key`, or None."""
        row = self._db.execute("SELECT response FROM replies WHERE key = ?", (key,)).fetchone()
        return None if row is None else _unpack(row[0])

    def put(self, key: str, request: dict[str, Any], response: dict[str, Any]) -> None:
        """Store one reply durably (committed and synced when this returns)."""
        self._db.execute(
            "INSERT OR REPLACE INTO replies (key, request, response, created) VALUES (?, ?, ?, ?)",
            (key, _pack(request), _pack(response), time.time()),
        )

    def keys(self) -> set[str]:
        return {row[0] for row in self._db.execute("SELECT key FROM replies")}

    def prune(self, keep: Iterable[str]) -> int:
        """Delete every entry whose key is not in `keep`; return how many were deleted."""
        keep = set(keep)
        stale = [k for k in self.keys() if k not in keep]
        self._db.execute("BEGIN IMMEDIATE")
        self._db.executemany("DELETE FROM replies WHERE key = ?", ((k,) for k in stale))
        self._db.execute("COMMIT")
        if stale:
            self._db.execute("VACUUM")
        return len(stale)
