"""A job's finished outputs kept by the key of what made them: early cut-off.

Snakemake reruns a job when anything upstream was rewritten, even with the same bytes (a
generate whose code changed but whose requests did not), and when a setting that cannot
change the job's outputs changes. A job that computes a key over what really decides its
outputs (docs/invalidation.md: inputs by content, the settings and code that shape them, the
software, hardware and environment that compute them) finds them here and links them back in
seconds instead of loading the verifier again: drafts, benchmark measurements, parity
replays. (The hidden states keep a store of their own, per sample: runtime.state_store.)

What the cache never does:
- serve a job the user forced (`-R`, `--forcerun`, `--forceall`, `-f`) or whose output was
  deleted: the plan marks those jobs (`mark_planned_jobs`, called while Snakemake builds the
  DAG) and they recompute; `EAGLEFLOW_OUTPUT_CACHE=off` recomputes every planned job;
- hand back a changed file: an entry's files are read-only and their sha256 is kept beside
  them, checked on every restore (read again only where a file's size or write time moved
  from the cache's own stamp, as git's index does); an entry that no longer matches is
  dropped and the job recomputes;
- lose a finished job: where a hard link is impossible (another filesystem, a mount without
  links) the entry is a reflink or a copy.

Run-only: this decides whether a job recomputes, never what it computes; the keys are data
(common.cache_keys and each stage's key).
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import stat
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagleflow.common.cache_keys import job_key
from eagleflow.runtime.cache_plan import (
    MANIFEST,
    SWITCH,
    cache_enabled,
    cached_rule,
    clear_mark,
    entry_location,
    recompute_reason,
)

log = logging.getLogger(__name__)

# errnos of a hard link that cannot be made where a copy can: another filesystem, a filesystem
# without hard links (FUSE, object-store mounts), too many links.
NO_LINK = frozenset({errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS})
FICLONE = 0x40049409  # linux/fs.h: share the source's extents (btrfs, XFS, bcachefs)
READ_ONLY = ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH)


class OutputCache:
    """Outputs (files or directories, by name) of one slot (a draft, a variant's benchmark),
    by key, in directory `dir`: one entry per slot, `<dir>/<slot>.<key>/`."""

    def __init__(self, dir: str | os.PathLike, slot: str):
        self.dir = Path(dir)
        self.slot = slot

    def _entry(self, key: str) -> Path:
        return self.dir / f"{self.slot}.{key}"

    def restore(self, key: str, outputs: Mapping[str, str | os.PathLike]) -> bool:
        """Put the outputs kept under `key` back at their paths; False (nothing written) if
        there is no complete, unchanged entry for `key`, if the plan marked this job to
        recompute, or if the cache is switched off."""
        if not cache_enabled():
            log.info("output cache off (%s=off): recomputing", SWITCH)
            return False
        why = recompute_reason(outputs.values())
        if why:
            log.info("recomputing, not restoring: %s", why)
            return False
        entry = self._entry(key)
        manifest = _read_manifest(entry)
        if manifest is None or sorted(manifest["outputs"]) != sorted(outputs):
            return False
        changed = _changed_files(entry, manifest)
        if changed:
            log.warning(
                "output cache entry %s no longer holds what was kept (%s changed since: edited in place?); "
                "dropping it and recomputing",
                entry,
                ", ".join(changed[:3]),
            )
            _remove(entry)
            return False
        # Snakemake plans a job again whose output is older than an input: a restored output
        # is as new as the job that restored it (every link of the file with it).
        stamp = time.time_ns()
        for name, out in outputs.items():
            _place(entry / name, Path(out))
            _stamp(Path(out), stamp)
        try:  # the stamp moved the write times: the next restore trusts the new ones
            _write_manifest(entry, {**manifest, **_stats(entry, manifest["files"], stamp)})
        except OSError as exc:  # an entry this user cannot write: the next restore reads it whole
            log.info("could not record the restored files' times in %s (%s)", entry, exc)
        return True

    def keep(self, key: str, outputs: Mapping[str, str | os.PathLike]) -> None:
        """Keep the finished `outputs` under `key` (hard links, read-only, digests beside
        them), dropping the slot's entries of other keys."""
        entry = self._entry(key)
        self.dir.mkdir(parents=True, exist_ok=True)
        for old in self.dir.glob(f"{self.slot}.*"):
            if old != entry:
                _remove(old)
        tmp = entry.with_name(f".{entry.name}.tmp")
        _remove(tmp)
        tmp.mkdir()
        for name, out in outputs.items():
            _link_tree(Path(out), tmp / name)
        files = {rel: _sha256(tmp / rel) for rel in _files_under(tmp)}
        stamp = time.time_ns()
        for rel in files:
            _make_read_only(tmp / rel)
            _stamp(tmp / rel, stamp)
        manifest = {"outputs": {n: str(o) for n, o in outputs.items()}, "files": files, "kept_at": time.time()}
        _write_manifest(tmp, {**manifest, **_stats(tmp, files, stamp)})
        _remove(entry)
        os.replace(tmp, entry)


# --- the job side --------------------------------------------------------------------------


def reuse_or_make(smk: Any, make: Callable[[], None], log: logging.Logger, stack: Mapping[str, Any]) -> None:
    """Run `make` (the job's body), unless a job of this rule with the same key (job_key of
    its inputs, params and `stack`: common.cache_keys.stack_identity) finished before: then
    put its outputs back."""
    outputs = dict(smk.output.items())
    cache = OutputCache(*entry_location(cached_rule(smk.rule) or smk.rule, list(outputs.values())))
    key = job_key(dict(smk.input.items()), dict(smk.params.items()), stack)
    if cache.restore(key, outputs):
        log.info(
            "made from the same inputs, settings, code and software before (key %s): outputs linked back from %s",
            key,
            cache.dir,
        )
        return
    make()
    cache.keep(key, outputs)
    clear_mark(outputs.values())


# --- files ---------------------------------------------------------------------------------


def _files_under(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def _read_manifest(entry: Path) -> dict[str, Any] | None:
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
    except (OSError, ValueError):
        return None  # no entry, a half-kept one, or one kept before manifests
    return manifest if isinstance(manifest, dict) and {"outputs", "files"} <= manifest.keys() else None


def _write_manifest(entry: Path, manifest: Mapping[str, Any]) -> None:
    tmp = entry / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, entry / MANIFEST)


def _stat(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns]


def _stats(entry: Path, files: Mapping[str, str], stamp: int) -> dict[str, Any]:
    """Each kept file's size and write time as its digest holds now (git's index), when that
    was read, and the write time the cache itself gave the files (`stamp`, to the nanosecond),
    or None where the filesystem keeps coarser times."""
    stat = {rel: _stat(entry / rel) for rel in files}
    exact = all(times[1] == stamp for times in stat.values())
    return {"stat": stat, "stat_at": time.time_ns(), "stamp": stamp if exact else None}


# A write time this close to when it was recorded may hide a later write in the same clock
# tick (file times advance by the kernel's tick, not by the nanosecond): git's "racy" entries.
RACY_NS = 2_000_000_000


def _changed_files(entry: Path, manifest: Mapping[str, Any]) -> list[str]:
    """The kept files that are missing, added or no longer hold the bytes kept. As git's index:
    a file whose size and write time are those recorded with its digest is taken as unchanged
    when that time is the cache's own nanosecond stamp (a write in place takes the kernel's
    clock, which is not it) or lies well before the record; the others are read whole and
    hashed. So a terabyte of shards comes back without being read."""
    files = manifest["files"]
    stats, stat_at, stamp = manifest.get("stat") or {}, manifest.get("stat_at", 0), manifest.get("stamp")
    present = set(_files_under(entry))
    changed = sorted(present ^ set(files))
    for rel in sorted(present & set(files)):
        now = _stat(entry / rel)
        recorded = list(stats.get(rel) or []) == now
        trusted = recorded and (now[1] == stamp or now[1] < stat_at - RACY_NS)
        if not trusted and _sha256(entry / rel) != files[rel]:
            changed.append(rel)
    return changed


def _sha256(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _make_read_only(path: Path) -> None:
    os.chmod(path, stat.S_IMODE(path.stat().st_mode) & READ_ONLY)


def _copy_file(src: Path, dst: Path) -> None:
    """A reflink where the filesystem shares extents, else a byte copy."""
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        try:
            fcntl.ioctl(fout.fileno(), FICLONE, fin.fileno())
        except OSError:
            shutil.copyfileobj(fin, fout, 1 << 24)
    shutil.copystat(src, dst)


def _link_file(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError as exc:
        if exc.errno not in NO_LINK:
            raise
        log.info("cannot hard-link %s to %s (%s): copying", src, dst, errno.errorcode.get(exc.errno, exc.errno))
        _copy_file(src, dst)


def _link_tree(src: Path, dst: Path) -> None:
    """Hard-link (or copy) file `src`, or every file under directory `src`, to `dst`."""
    if src.is_dir():
        dst.mkdir(parents=True)
        for child in sorted(src.iterdir()):
            _link_tree(child, dst / child.name)
    else:
        _link_file(src, dst)


def _place(src: Path, out: Path) -> None:
    """Link `src` to `out` atomically: a temporary name next to it, then a rename."""
    tmp = out.with_name(f".{out.name}.restore.tmp")
    _remove(tmp)
    out.parent.mkdir(parents=True, exist_ok=True)
    _link_tree(src, tmp)
    if out.is_dir() and not out.is_symlink():
        shutil.rmtree(out)  # a directory cannot be renamed over one that has files
    os.replace(tmp, out)


def _stamp(path: Path, ns: int) -> None:
    """Give `path` (and everything under it) the write time `ns`."""
    for p in [path, *(sorted(path.rglob("*")) if path.is_dir() else [])]:
        os.utime(p, ns=(ns, ns))


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


# --- prune and usage -----------------------------------------------------------------------

CACHE_DIR_NAMES = (".done", "done")


@dataclass(frozen=True)
class Entry:
    path: Path
    outputs: tuple[Path, ...]
    kept_at: float
    exclusive_bytes: int  # bytes only the entry holds (no output links to them)
    live: bool  # every output it restores to still exists


def entries(results: str | os.PathLike) -> list[Entry]:
    """Every output cache entry under `results` (a run directory, or results/)."""
    found = []
    for cache_dir in sorted(p for p in Path(results).rglob("*") if p.is_dir() and p.name in CACHE_DIR_NAMES):
        for entry in sorted(cache_dir.iterdir()):
            manifest = _read_manifest(entry) if entry.is_dir() else None
            if manifest is None:
                continue
            outputs = tuple(_output_path(entry, o) for o in manifest["outputs"].values())
            exclusive = sum((entry / rel).stat().st_size for rel in manifest["files"] if _nlink(entry / rel) == 1)
            found.append(
                Entry(entry, outputs, float(manifest.get("kept_at", 0)), exclusive, all(o.exists() for o in outputs))
            )
    return found


def _output_path(entry: Path, output: str) -> Path:
    """Where an output an entry restores to is, wherever `prune` runs: the manifest holds it as
    the job named it, relative to the workflow's directory, and the entry lies inside that
    directory's tree (`results/<run>/.../.done/<entry>` for `results/<run>/...`). So the
    workflow's directory is the parent of the entry's nearest ancestor named as the output's
    first component. Pure."""
    path = Path(output)
    if path.is_absolute():
        return path
    top = path.parts[0]
    for ancestor in entry.parents:
        if ancestor.name == top:
            return ancestor.parent / path
    return path  # not under its own tree: as named, from here


def _nlink(path: Path) -> int:
    try:
        return path.stat().st_nlink
    except FileNotFoundError:
        return 0


def cache_bytes(results: str | os.PathLike) -> tuple[int, int]:
    """(entries, bytes only the cache holds) under `results`: what prune can free."""
    found = entries(results)
    return len(found), sum(e.exclusive_bytes for e in found)


def prune(results: str | os.PathLike, max_bytes: int | None = None, dry_run: bool = False) -> list[Entry]:
    """Drop the entries of slots that no longer exist (an output they restore to is gone),
    then the oldest entries that hold bytes of their own until those bytes are at most
    `max_bytes` (an entry whose files are all links of the outputs in place frees nothing).
    Returns the entries dropped. Outputs in place are never touched."""
    found = entries(results)
    dropped = [e for e in found if not e.live]
    left = sorted((e for e in found if e.live and e.exclusive_bytes), key=lambda e: e.kept_at)
    if max_bytes is not None:
        total = sum(e.exclusive_bytes for e in left)
        while left and total > max_bytes:
            oldest = left.pop(0)
            dropped.append(oldest)
            total -= oldest.exclusive_bytes
    if not dry_run:
        for entry in dropped:
            _remove(entry.path)
    return dropped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m eagleflow.runtime.output_cache",
        description="Show or prune eagleflow's output cache (entries under .done/ and train/done/).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    show = sub.add_parser("usage", help="entries and the bytes only the cache holds")
    show.add_argument("results", nargs="?", default="results")
    pr = sub.add_parser(
        "prune",
        help="drop entries of slots that no longer exist, then the oldest over a size bound, and the stored "
        "hidden states no index names",
    )
    pr.add_argument("results", nargs="?", default="results")
    pr.add_argument("--max-gb", type=float, help="keep at most this many GB that only the cache holds")
    pr.add_argument("--dry-run", action="store_true", help="list what would be dropped")
    args = parser.parse_args(argv)
    if args.command == "usage":
        n, size = cache_bytes(args.results)
        print(f"{n} entries under {args.results}; {size / 1e9:.3f} GB held only by the cache")
        return 0
    max_bytes = None if args.max_gb is None else int(args.max_gb * 1e9)
    dropped = prune(args.results, max_bytes, args.dry_run)
    verb = "would drop" if args.dry_run else "dropped"
    for entry in dropped:
        why = "slot gone" if not entry.live else "oldest over the bound"
        print(f"{verb} {entry.path} ({entry.exclusive_bytes / 1e9:.3f} GB, {why})")
    print(f"{verb} {len(dropped)} entries, {sum(e.exclusive_bytes for e in dropped) / 1e9:.3f} GB")
    # The hidden states' sample stores: what neither an index nor a part manifest names
    # (a sample whose conversation was dropped or changed) is no longer read by anything.
    from eagleflow.runtime.state_store import prune_unreferenced

    for store, files, nbytes in prune_unreferenced(args.results, args.dry_run):
        print(f"{verb} {files} stored samples no index names under {store} ({nbytes / 1e9:.3f} GB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
