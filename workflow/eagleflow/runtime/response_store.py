"""The response store: every reply the verifier gave, keyed by its request.

SQLite in WAL mode (Python's stdlib): each reply is one committed transaction, synced to
disk before the next request is counted done, so a job killed at any instant (SIGKILL
included) loses at most the replies still in flight, never a stored one, and leaves no torn
record. Lookups are indexed.

Where the store lives decides how it is locked (`generate.store_locking`):
- `shared`, on a local filesystem: WAL's index in shared memory (the `-shm` file every
  process maps), so several readers may open the store while a job writes.
- `exclusive`, on a network filesystem (NFS, Lustre, GPFS, CIFS, ...), where `results/` sits
  on a cluster: SQLite documents that WAL's shared memory does not work across hosts and that
  file locking over NFS is unreliable. The store is opened by one process at a time: SQLite's
  exclusive locking mode, set before WAL is entered, keeps WAL's index in the process's own
  memory (no `-shm` file is ever made), and an owner file (`<store>.owner`: host, pid, start,
  created with O_EXCL, which NFS v3+ makes atomic) refuses a second opener, on this host or
  another, with a clear error naming the holder, before SQLite is asked for a lock it may
  not enforce. A holder on this host that is gone (killed) is taken over; one on another
  host is refused until its owner file is removed.
- `auto` (default): `exclusive` when the store's filesystem is a network one (`/proc/mounts`),
  else `shared`.
The replies and their keys are the same in both: a store moves between them as it is.

Generation in shards (`generate.shards`): shard i of n writes its own file beside the
configured one, `<store>.<i>-of-<n>.sqlite` (one shard: the configured file itself), so no file
ever has two writers. Its conversations' replies may sit in the files of another shard count
(or the configured file, which write_prompts fills): those are its `older` stores, read on the
store-only pass (a reply found there is copied into the shard's own file) and closed before
the server pass (`close_older`). The files of the shard's own count are never read: those
hold other conversations, and their shards may be writing them.

Entries are never dropped by a run: a key no current request uses (an old prompt, an older
sampling setting) stays until `python -m eagleflow.generate prune` removes it.

Without a shared filesystem (`storage.responses: s3://bucket/prefix`, set for the job by
runtime.smk.stage as EAGLEFLOW_RESPONSE_BUCKET) the SQLite file is the job's local copy and the
bucket holds the store: one object per reply under `<prefix>/replies/<key[:2]>/<key>`, published
by `put` before it returns, so a job killed on any node loses no reply and its rerun, wherever it
runs, sends no request twice. Opening the store fetches the replies the local copy lacks and
publishes the ones the bucket lacks (a job killed between its commit and its upload). No SQLite
file is ever opened over S3, and there is nothing to merge: the replies of every job are the
bucket's objects.
"""

from __future__ import annotations

import glob
import json
import os
import re
import socket
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


BUCKET_ENV = "EAGLEFLOW_RESPONSE_BUCKET"  # s3://bucket/prefix: the store in a bucket (storage.responses)


class StoreError(RuntimeError):
    pass


# Filesystem types (as /proc/mounts names them) shared between hosts.
NETWORK_FILESYSTEMS = (
    "nfs",
    "nfs4",
    "lustre",
    "gpfs",
    "cifs",
    "smb3",
    "smbfs",
    "beegfs",
    "ceph",
    "glusterfs",
    "fuse.glusterfs",
    "fuse.sshfs",
    "9p",
    "panfs",
    "wekafs",
)
LOCKING = ("auto", "shared", "exclusive")


def filesystem_type(path: str | os.PathLike, mounts: str | None = None) -> str:
    """The type of the filesystem `path` is on: the longest mount point above it in
    /proc/mounts (`mounts`: that file's text). "unknown" without /proc."""
    if mounts is None:
        try:
            mounts = Path("/proc/mounts").read_text()
        except OSError:
            return "unknown"
    real = os.path.realpath(path)
    best, kind = "", "unknown"
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) > len(best):
            best, kind = point, fields[2]
    return kind


def resolve_locking(locking: str, path: str | os.PathLike, mounts: str | None = None) -> str:
    """`shared` or `exclusive` for a store at `path` (`auto`: by its filesystem)."""
    if locking not in LOCKING:
        raise ValueError(f"generate.store_locking: {locking!r} is not one of {LOCKING}")
    if locking != "auto":
        return locking
    return "exclusive" if filesystem_type(Path(path).parent, mounts) in NETWORK_FILESYSTEMS else "shared"


SHARD_FILE = re.compile(r"\.(\d+)-of-(\d+)$")


def shard_store(base: str | os.PathLike, index: int, count: int) -> Path:
    """The store file shard `index` of `count` writes: the configured one for one shard."""
    base = Path(base)
    return base if count == 1 else base.with_name(f"{base.stem}.{index}-of-{count}{base.suffix}")


def store_files(base: str | os.PathLike) -> list[Path]:
    """Every file of the store configured as `base`: itself and its shards' files, existing."""
    base = Path(base)
    shards = [p for p in base.parent.glob(f"{glob.escape(base.stem)}.*-of-*{base.suffix}") if SHARD_FILE.search(p.stem)]
    return [p for p in [base, *sorted(shards)] if p.is_file()]


def older_stores(base: str | os.PathLike, count: int) -> list[Path]:
    """The files a shard of a `count`-shard run reads besides its own: those of every other
    shard count (and, sharded, the configured file)."""
    return [
        p
        for p in store_files(base)
        if not ((m := SHARD_FILE.search(p.stem)) and int(m.group(2)) == count) and not (count == 1 and p == Path(base))
    ]


class Owner:
    """`<store>.owner`: which process holds a store opened exclusively."""

    def __init__(self, store: Path):
        self.path = store.with_name(store.name + ".owner")
        self.me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}

    def acquire(self, wait_s: float = 0.0) -> None:
        """Hold the store, or raise StoreError naming its holder (after `wait_s` seconds of
        asking again: a shard reading an older store waits while another shard reads it)."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is not None and self._gone(holder):
                    self.path.unlink(missing_ok=True)  # a killed job of this host: take over
                    continue
                if time.monotonic() >= deadline:
                    raise StoreError(self._refusal(holder)) from None
                time.sleep(1.0)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(self.me, f)
                f.flush()
                os.fsync(f.fileno())
            return

    def release(self) -> None:
        holder = self._holder()
        if holder and holder.get("host") == self.me["host"] and holder.get("pid") == self.me["pid"]:
            self.path.unlink(missing_ok=True)

    def _holder(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None  # being written, or removed meanwhile

    def _gone(self, holder: dict[str, Any]) -> bool:
        if holder.get("host") != self.me["host"]:
            return False  # no way to see another host's processes
        try:
            os.kill(int(holder["pid"]), 0)
        except ProcessLookupError:
            return True
        except (PermissionError, KeyError, ValueError, TypeError):
            return False
        return False

    def _refusal(self, holder: dict[str, Any] | None) -> str:
        who = (
            f"process {holder.get('pid')} on host {holder.get('host')} since "
            f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(holder.get('started', 0)))}"
            if holder
            else "another process"
        )
        return (
            f"response store {self.path.with_suffix('')} is open by {who} (exclusive locking: it is on a "
            f"network filesystem, or generate.store_locking says so). Two writers would corrupt it. Wait for "
            f"that job, or give this one another generate.store; if that job is gone for good (its host "
            f"died), remove {self.path}."
        )


def _pack(value: dict[str, Any]) -> bytes:
    # Replies are mostly token-id lists: zlib makes them 3-5x smaller at no noticeable cost.
    return zlib.compress(json.dumps(value, ensure_ascii=False).encode(), 3)


def _unpack(blob: bytes) -> dict[str, Any]:
    return json.loads(zlib.decompress(blob))


class ResponseStore:
    """Replies by request key. Use as a context manager (or call `close`). `locking`:
    `auto`, `shared` or `exclusive` (see the module's docstring); `busy_timeout_s`: how long
    an operation waits for another process's lock (and, exclusive, for another process to
    let go of an older store); `older`: store files `get` also reads (sharded generation)."""

    def __init__(
        self,
        path: str | os.PathLike,
        locking: str = "auto",
        busy_timeout_s: float = 60.0,
        older: Iterable[str | os.PathLike] = (),
        wait_s: float = 0.0,
        mirrored: bool = True,
    ):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.locking = resolve_locking(locking, self.path)
        self.busy_timeout_s = busy_timeout_s
        self._older_paths = [Path(p) for p in older if Path(p) != self.path]
        self._older: list[ResponseStore] | None = None
        self.adopted = 0  # replies copied in from older stores
        self._mirror = None
        self.fetched = self.published = 0  # replies the bucket's store gave and took at opening
        self._owner = Owner(self.path) if self.locking == "exclusive" else None
        if self._owner is not None:
            self._owner.acquire(wait_s)
        try:
            self._db = sqlite3.connect(self.path, timeout=busy_timeout_s, isolation_level=None)
            if self._owner is not None:
                # Before WAL is entered: SQLite then keeps WAL's index in this process's memory,
                # never in a shared-memory file, and holds the database until it is closed.
                self._db.execute("PRAGMA locking_mode=EXCLUSIVE")
            self._db.execute("PRAGMA journal_mode=WAL")
            # FULL: a commit is on disk when it returns, so a stored reply survives a crash.
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute(SCHEMA)
        except sqlite3.DatabaseError as exc:
            if self._owner is not None:
                self._owner.release()
            if "locked" in str(exc):
                raise StoreError(
                    f"response store {self.path} is locked by another process ({exc}); wait for it, or give "
                    "this job another generate.store"
                ) from exc
            raise StoreError(
                f"response store {self.path} cannot be opened ({exc}). Move it aside to start an empty one "
                f"(every reply it held will be requested again), or point generate.store at another file."
            ) from exc
        bucket = os.environ.get(BUCKET_ENV)
        if bucket and mirrored:
            from eagleflow.runtime.reply_bucket import ReplyBucket

            try:
                self._mirror = ReplyBucket(bucket)
                self.fetched, self.published = self._mirror.sync(self)
            except BaseException:
                self.close()
                raise

    def __enter__(self) -> ResponseStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.close_older()
        self._db.close()
        if self._owner is not None:
            self._owner.release()

    def __len__(self) -> int:
        return self._db.execute("SELECT COUNT(*) FROM replies").fetchone()[0]

    def get(self, key: str) -> dict[str, Any] | None:
        """The stored reply body for `key`, or None. A reply only an older store holds is
        copied into this one first."""
        row = self._db.execute("SELECT response FROM replies WHERE key = ?", (key,)).fetchone()
        if row is not None:
            return _unpack(row[0])
        for older in self._older_stores():
            found = older._db.execute("SELECT request, response, created FROM replies WHERE key = ?", (key,)).fetchone()
            if found is not None:
                self._insert(key, *found)
                self.adopted += 1
                return _unpack(found[1])
        return None

    def _older_stores(self) -> list[ResponseStore]:
        if self._older is None:
            self._older = []
            try:
                for path in self._older_paths:
                    if path.is_file():
                        # Exclusive: wait while another shard reads it (they all may, at their start).
                        wait = self.busy_timeout_s * 10
                        self._older.append(
                            ResponseStore(path, self.locking, self.busy_timeout_s, wait_s=wait, mirrored=False)
                        )
            except BaseException:
                self.close_older()
                raise
        return self._older

    def close_older(self) -> None:
        """Let go of the older stores (the store-only pass is over); `get` reads only this one after."""
        for older in self._older or []:
            older.close()
        self._older, self._older_paths = [], []

    def put(self, key: str, request: dict[str, Any], response: dict[str, Any]) -> None:
        """Store one reply durably (committed and synced when this returns; in the bucket too,
        where the store is one)."""
        request_blob, response_blob, created = _pack(request), _pack(response), time.time()
        self._insert(key, request_blob, response_blob, created)
        if self._mirror is not None:
            self._mirror.publish(key, request_blob, response_blob, created)

    def _insert_many(self, rows: Iterable[tuple[str, bytes, bytes, float]]) -> None:
        """Rows in one transaction (one sync, not one per row)."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            self._db.executemany(
                "INSERT OR REPLACE INTO replies (key, request, response, created) VALUES (?, ?, ?, ?)", rows
            )
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def _insert(self, key: str, request: bytes, response: bytes, created: float) -> None:
        self._db.execute(
            "INSERT OR REPLACE INTO replies (key, request, response, created) VALUES (?, ?, ?, ?)",
            (key, request, response, created),
        )

    def keys(self) -> set[str]:
        return {row[0] for row in self._db.execute("SELECT key FROM replies")}

    def _row(self, key: str) -> tuple[str, bytes, bytes, float]:
        request, response, created = self._db.execute(
            "SELECT request, response, created FROM replies WHERE key = ?", (key,)
        ).fetchone()
        return key, request, response, created

    def prune(self, keep: Iterable[str]) -> int:
        """Delete every entry whose key is not in `keep`; return how many were deleted."""
        keep = set(keep)
        stale = [k for k in self.keys() if k not in keep]
        self._db.execute("BEGIN IMMEDIATE")
        self._db.executemany("DELETE FROM replies WHERE key = ?", ((k,) for k in stale))
        self._db.execute("COMMIT")
        if stale:
            self._db.execute("VACUUM")
        if self._mirror is not None:
            self._mirror.delete(stale)
        return len(stale)
