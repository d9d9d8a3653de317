"""Content identities of the files a stage reads, for the keys of its outputs: the verifier's
and any file's or directory's. Both hash every byte: a merged LoRA or a re-quantized layer of
the same shapes is another verifier. Paths and mtimes do not count: the same files elsewhere
are the same inputs.

A terabyte checkpoint stays cheap because each file's sha256 is computed once per change:
files are hashed in parallel, and each digest is remembered like git's index (by real path,
checked against size, mtime, inode and ctime) in a small JSON file, so the next fingerprint of
unchanged files is a stat per file. Files in a Hugging Face hub cache are not read at all: the
name of an LFS blob is already the sha256 of its content.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

log = logging.getLogger(__name__)

# Read size of the streaming hash: large reads suit network filesystems, and hashlib releases
# the GIL while it hashes a block, so threads hash files on separate cores.
BLOCK_BYTES = 1 << 22
# Above this many bytes to hash, verifier_fingerprint shows a progress bar on stderr.
PROGRESS_MIN_BYTES = 2 << 30
# At most this many files are hashed at once (one thread each; a block buffer each).
MAX_THREADS = 64
# The "racy git" window: a digest is not remembered for a file changed less than this long
# before it was hashed (see _rememberable).
RACY_WINDOW_NS = 2_000_000_000

CACHE_ENV = "EAGLEFLOW_DIGEST_CACHE"  # path of the remembered digests; "" remembers nothing
CACHE_VERSION = 1
# A Hugging Face hub cache blob: `.../blobs/<sha256 of the content>` for LFS files.
_HUB_SHA256 = re.compile(r"[0-9a-f]{64}")


def verifier_fingerprint(model_dir: str | os.PathLike, *, progress: bool = True) -> str:
    """A content fingerprint of a model directory: every file's relative name and sha256
    (symlinks followed; docs, VCS metadata and eagleflow's notes left out: `_ignored`).

    Copying or re-linking the same files keeps it; mtimes do not count. Each file is read
    once per change (`file_digests`); `progress`: a bar on stderr while more than a few GB
    are hashed.
    """
    root = Path(model_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"verifier directory {root} does not exist (prepare_verifier makes it)")
    files = sorted(p for p in root.rglob("*") if p.is_file() and not _ignored(p.relative_to(root)))
    digests = file_digests(files, progress=progress)
    h = hashlib.sha256()
    for path in files:
        h.update(f"{path.relative_to(root).as_posix()}\0{digests[path]}\0".encode())
    return h.hexdigest()[:32]


def _ignored(rel: Path) -> bool:
    """Files that cannot change a reply: docs, VCS metadata, caches, and eagleflow's own notes
    (`eagleflow_source.json` names where the embedded GGUF was found: a path, not weights)."""
    return (
        any(part.startswith(".") or part == "__pycache__" for part in rel.parts)
        or rel.name.startswith("eagleflow_")
        or rel.suffix.lower() in (".md", ".png", ".jpg")
    )


def content_digest(path: str | os.PathLike) -> str:
    """sha256 of a file's bytes, or of a directory's files (relative names and bytes), whole."""
    root = Path(path)
    h = hashlib.sha256()
    files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
    for file in files:
        h.update(f"{file.relative_to(root).as_posix() if root.is_dir() else ''}\0".encode())
        with open(file, "rb", buffering=0) as fh:
            stream_into(h, fh)
        h.update(b"\0")
    return h.hexdigest()[:32]


def stream_into(h: Any, fh: Any, on_block: Callable[[int], None] | None = None) -> None:
    """Feed an open binary file's remaining bytes to hash `h` in BLOCK_BYTES reads into one
    buffer (no copy per block; `hashlib.file_digest` reads 256 KiB at a time and reports no
    progress). `on_block(n)` after each block: the progress bar."""
    buf = bytearray(BLOCK_BYTES)
    view = memoryview(buf)
    while n := fh.readinto(buf):
        h.update(view[:n])
        if on_block is not None:
            on_block(n)


class Stat(NamedTuple):
    """What says a file is unchanged since its digest was taken (git's index checks the same):
    ctime catches an in-place edit whose old mtime was put back (`touch -d`, os.utime), the
    inode a file replaced by another of the same size and times."""

    size: int
    mtime_ns: int
    inode: int
    ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> Stat:
        return cls(st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)


def file_digests(files: Iterable[Path], *, progress: bool = False, threads: int | None = None) -> dict[Path, str]:
    """Each file's content digest, "sha256:<hex>" (symlinks followed), read only where needed:
    a hub cache blob by its name, an unchanged file by its remembered digest, the others
    hashed whole, largest first, `threads` at a time (default: one per CPU this process may
    run on). Newly hashed digests are remembered (`digest_cache_path`)."""
    files = list(files)
    cache_path = digest_cache_path()
    remembered, cache_unusable = _load_cache(cache_path) if cache_path else ({}, False)
    digests: dict[Path, str] = {}
    todo: list[tuple[Path, str, int]] = []
    for path in files:
        real = os.path.realpath(path)
        st = _stat(path)
        hub = hub_blob_digest(real)
        entry = remembered.get(real)
        if hub is not None:
            digests[path] = hub
        elif entry is not None and Stat(*entry["stat"]) == Stat.of(st):
            digests[path] = entry["digest"]
        else:
            todo.append((path, real, st.st_size))
    todo.sort(key=lambda t: t[2], reverse=True)
    learned = _hash_all(todo, progress=progress, threads=threads)
    for (path, _, _), (digest, _) in zip(todo, learned, strict=True):
        digests[path] = digest
    new = {
        real: {"digest": d, "stat": list(st)}
        for (_, real, _), (d, st) in zip(todo, learned, strict=True)
        if st is not None
    }
    if cache_path and (new or cache_unusable):
        _save_cache(cache_path, new)
    return digests


def _stat(path: Path) -> os.stat_result:
    try:
        return os.stat(path)
    except OSError as exc:
        raise OSError(f"{path}: cannot stat it for its content digest ({exc}): is it a dangling symlink?") from exc


def hub_blob_digest(real_path: str) -> str | None:
    """The digest a Hugging Face hub cache already holds for a file: in
    `models--org--name/snapshots/<rev>/<file>` -> `../../blobs/<hash>`, an LFS file's blob is
    named by the sha256 of its content, so the name is its "sha256:<hex>", the same digest as
    that of a copy of the file elsewhere. Trusted only for a 64-hex name in a directory named
    `blobs` (the hub never rewrites a blob in place; a blob edited by hand is not noticed).

    Non-LFS blobs are named by the 40-hex git blob sha1 (of the git object, not the raw
    bytes): they are not used, because a copy of the file elsewhere would then have another
    digest (another key for the same verifier); they are small text files (config, tokenizer),
    hashed in no time and remembered.
    """
    real = Path(real_path)
    if real.parent.name == "blobs" and _HUB_SHA256.fullmatch(real.name):
        return f"sha256:{real.name}"
    return None


def _hash_all(
    todo: list[tuple[Path, str, int]], *, progress: bool, threads: int | None
) -> list[tuple[str, Stat | None]]:
    """(digest, the Stat to remember it by, None when it is too fresh to) of each file in
    `todo`, in its order, hashed on a thread pool with an optional progress bar."""
    if not todo:
        return []
    total = sum(size for _, _, size in todo)
    bar = _progress_bar(total, len(todo)) if progress and total > PROGRESS_MIN_BYTES else None
    lock = threading.Lock()

    def advance(n: int) -> None:
        with lock:
            bar.update(n)

    on_block = advance if bar is not None else None
    workers = min(len(todo), MAX_THREADS, threads or len(os.sched_getaffinity(0)))
    try:
        if workers == 1:
            return [hash_file(real, on_block) for _, real, _ in todo]
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="digest") as pool:
            return list(pool.map(lambda t: hash_file(t[1], on_block), todo))
    finally:
        if bar is not None:
            bar.close()


def _progress_bar(total: int, count: int) -> Any:
    from tqdm import tqdm

    return tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=f"sha256 of {count} verifier files",
        file=sys.stderr,
        mininterval=1.0 if sys.stderr.isatty() else 30.0,  # a job's log gets a line per 30 s
    )


def hash_file(path: str, on_block: Callable[[int], None] | None = None, attempts: int = 3) -> tuple[str, Stat | None]:
    """The "sha256:<hex>" of a file's bytes and the Stat to remember it by (None: too fresh,
    `_rememberable`). A file that changes while it is read is read again, `attempts` times."""
    for _ in range(attempts):
        with open(path, "rb", buffering=0) as fh:
            before = Stat.of(os.fstat(fh.fileno()))
            h = hashlib.sha256()
            stream_into(h, fh, on_block)
            after = Stat.of(os.fstat(fh.fileno()))
        if before == after:
            return f"sha256:{h.hexdigest()}", after if _rememberable(after, time.time_ns()) else None
    raise RuntimeError(
        f"{path} changed while it was hashed, {attempts} times: is something still writing it? "
        "Wait until it is finished, then run again"
    )


def _rememberable(st: Stat, now_ns: int) -> bool:
    """Whether a digest taken now may be remembered by `st`. The "racy git" problem: a file
    written again right after it was hashed, within the granularity of its timestamps (1 s on
    some filesystems, a clock tick on others), may keep the same size, mtime and ctime, so its
    remembered digest would pass for the new bytes. Git handles it by not trusting index
    entries whose mtime is not older than the index itself; here, a file changed less than
    RACY_WINDOW_NS before it was hashed is not remembered (the next call hashes it again).
    Timestamps set by a file server with a clock behind ours by more than the window defeat
    this: keep cluster clocks in sync (NTP)."""
    return now_ns - max(st.mtime_ns, st.ctime_ns) >= RACY_WINDOW_NS


def digest_cache_path() -> Path | None:
    """Where digests are remembered: $EAGLEFLOW_DIGEST_CACHE ("" remembers nothing), else
    $XDG_CACHE_HOME/eagleflow/file-digests.json (~/.cache by default). A JSON file, not
    SQLite: it may sit on a cluster's network filesystem, where SQLite's locks are unsafe."""
    setting = os.environ.get(CACHE_ENV)
    if setting is not None:
        return Path(setting).expanduser() if setting else None
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "eagleflow" / "file-digests.json"


def _load_cache(path: Path) -> tuple[dict[str, dict[str, Any]], bool]:
    """The remembered entries {real path: {"digest", "stat"}} and whether the file was
    unusable (then it is rewritten). A missing file is empty; an unreadable or corrupt one is
    empty with a warning: remembering saves time, it never stops a run."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}, False
    except OSError as exc:
        log.warning("%s: cannot read the remembered file digests (%s): hashing every file again", path, exc)
        return {}, True
    try:
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("version") != CACHE_VERSION or not isinstance(data["files"], dict):
            raise ValueError(f"not a version {CACHE_VERSION} digest cache")
    except (ValueError, KeyError) as exc:
        log.warning("%s: the remembered file digests are corrupt (%s): ignoring them, it is rewritten", path, exc)
        return {}, True
    return {k: v for k, v in data["files"].items() if _valid_entry(v)}, False


def _valid_entry(entry: Any) -> bool:
    return (
        isinstance(entry, dict)
        and isinstance(entry.get("digest"), str)
        and isinstance(entry.get("stat"), list)
        and len(entry["stat"]) == len(Stat._fields)
        and all(isinstance(x, int) for x in entry["stat"])
    )


def _save_cache(path: Path, new: dict[str, dict[str, Any]]) -> None:
    """Add `new` entries to the remembered digests. Merge-on-write: the file is read again
    just before it is atomically replaced (temp file + os.replace), so jobs writing at once
    lose at most each other's newest entries, never the file. Entries of paths that no longer
    exist are dropped. A cache that cannot be written is a warning, not an error."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        current, _ = _load_cache(path)
        merged = {real: e for real, e in {**current, **new}.items() if os.path.exists(real)}
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump({"version": CACHE_VERSION, "files": merged}, fh, sort_keys=True)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        log.warning(
            "%s: cannot remember file digests (%s): the next fingerprint hashes again; set %s to a writable "
            "file, or to an empty value to not remember",
            path,
            exc,
            CACHE_ENV,
        )
