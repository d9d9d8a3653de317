"""The hidden states of a run kept per sample, by key (the keys: hidden_states.sample_keys).

Layout: `<run>/hidden_states/samples/<key[:2]>/<key>.safetensors`, each a shard of one sample
(hidden_states.shard_file), written atomically and read-only once written. A job killed
mid-phase leaves whole files only; its rerun finds them. One key is one file, so nothing is
stored twice; where two jobs extract the same sample, the first writer's file stands (the job
skips a key stored meanwhile). What neither the index nor a part manifest (or a running
job's pending list) beside the store names is removed by
`python -m eagleflow.runtime.output_cache prune` (prune_unreferenced); run it when no job runs.

In a bucket (`storage.states: s3://bucket/prefix`, BucketSampleStore) the layout is the same
under the prefix: one object per sample, uploaded once from a local staging file and never
overwritten, its content digest in its metadata; the part manifests and the index (results/)
name the bucket, and training reads through runtime.object_store.FetchCache.

Run-only: where states lie and when they are dropped, never what they hold.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from eagleflow.runtime.object_store import Bucket, check_access, is_bucket_url

SUFFIX = ".safetensors"
STORE_DIR = "samples"  # beside index.json: results/<run>/hidden_states/samples/
PART_GLOB = "part-*.json"


def relative_path(key: str) -> str:
    """Where a sample's file lies under its store. Pure."""
    return f"{key[:2]}/{key}{SUFFIX}"


def states_location(config: dict[str, Any]) -> str | None:
    """Where the config keeps the run's per-sample store: `<storage.states>/<run>` in a bucket,
    or None (beside the index, results/<run>/hidden_states/samples)."""
    location = (config.get("storage") or {}).get("states")
    if not location:
        return None
    if not is_bucket_url(location):
        raise ValueError(f"storage.states: {location!r} is not an s3://bucket/prefix URL (null: beside the index)")
    return f"{location.rstrip('/')}/{config['run']}"


def sample_store(beside: str | os.PathLike, location: str | None) -> SampleStore | BucketSampleStore:
    """The store a part job writes to: the directory `beside` (results/<run>/hidden_states/
    samples), or the bucket `location` names (checked before any extraction)."""
    if location is None:
        return SampleStore(beside)
    check_access(location)
    return BucketSampleStore(location)


class SampleStore:
    """A directory of samples' states by key (the module's docstring)."""

    keeps_locally = True
    location = None  # the manifests name no store: it lies beside them

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    def path(self, key: str) -> Path:
        return self.root / relative_path(key)

    def has(self, key: str) -> bool:
        return self.path(key).is_file()

    def seal(self, key: str, digest: str = "") -> None:
        """Make a stored sample read-only: nothing edits states in place."""
        p = self.path(key)
        p.chmod(p.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))

    def digests(self, keys: Iterable[str], read: Callable[[Path], str]) -> dict[str, str]:
        """{key: the digest its file records} (`read`: hidden_states.shard_file's reader)."""
        return {k: read(self.path(k)) for k in keys}

    def header_file(self, key: str) -> Path:
        """A local file of the sample, to read its header from."""
        return self.path(key)

    def close(self) -> None:
        pass

    def keys(self) -> Iterator[str]:
        if not self.root.is_dir():
            return
        for sub in sorted(self.root.iterdir()):
            if sub.is_dir() and len(sub.name) == 2:
                for f in sorted(sub.glob(f"*{SUFFIX}")):
                    yield f.name[: -len(SUFFIX)]

    def remove_unreferenced(self, referenced: set[str], dry_run: bool = False) -> tuple[int, int]:
        """Remove the stored samples no key of `referenced` names, and the temporaries a killed
        writer left. Returns (files, bytes) removed (or that would be)."""
        files = nbytes = 0
        if not self.root.is_dir():
            return 0, 0
        for sub in self.root.iterdir():
            if not sub.is_dir():
                continue
            for f in sub.iterdir():
                key = f.name[: -len(SUFFIX)] if f.name.endswith(SUFFIX) else None
                if key in referenced:
                    continue
                files += 1
                nbytes += _tree_bytes(f)
                if not dry_run:
                    _remove(f)
        return files, nbytes


class BucketSampleStore:
    """The store in a bucket: `path(key)` is a local staging file the writer fills, `seal`
    uploads it once with its digest and drops it (the module's docstring)."""

    keeps_locally = False

    def __init__(self, location: str, staging: str | os.PathLike | None = None):
        self.bucket = Bucket(location)
        self.location = self.bucket.url
        self._staging = Path(staging) if staging else None
        self._digests: dict[str, str] = {}
        self._listed: set[str] | None = None
        self.uploaded = self.uploaded_bytes = 0

    @property
    def root(self) -> Path:
        """The local staging directory: a sample's file lies there from its write to its upload."""
        if self._staging is None:
            self._staging = Path(tempfile.mkdtemp(prefix="eagleflow-staging-"))
        return self._staging

    def path(self, key: str) -> Path:
        return self.root / relative_path(key)

    def has(self, key: str) -> bool:
        if self._listed is None:
            self._listed = set(self.keys())
        return key in self._listed

    def seal(self, key: str, digest: str = "") -> None:
        """Upload the staged sample (unless an object holds the key already: the first writer's
        stands) and free its local space."""
        if not digest:
            raise ValueError(f"{key}: a bucket's sample is sealed with its digest")
        path = self.path(key)
        size = path.stat().st_size
        if self.bucket.put_once(relative_path(key), path, digest):
            self.uploaded += 1
            self.uploaded_bytes += size
            self._digests[key] = digest
        else:
            self._digests.pop(key, None)  # the standing object's digest is read back if asked
        path.unlink()
        if self._listed is not None:
            self._listed.add(key)

    def digests(self, keys: Iterable[str], read: Callable[[Path], str] | None = None) -> dict[str, str]:
        """{key: the digest its object's writer recorded}, read in parallel where not known."""
        keys = list(dict.fromkeys(keys))
        unknown = [k for k in keys if k not in self._digests]
        with ThreadPoolExecutor(max_workers=32) as pool:
            found = pool.map(lambda k: self.bucket.recorded_digest(relative_path(k)), unknown)
            for k, d in zip(unknown, found, strict=True):
                if d is None:
                    raise FileNotFoundError(f"{self.bucket.where.url(relative_path(k))}: no such sample in the store")
                self._digests[k] = d
        return {k: self._digests[k] for k in keys}

    def header_file(self, key: str) -> Path:
        """The sample downloaded to the staging directory, unchecked: its header is all that is
        read (the index's dtype); training checks each sample's digest as it fetches it."""
        local = self.root / "headers" / relative_path(key)
        if not local.exists():
            self.bucket.download(relative_path(key), local)
        return local

    def keys(self) -> Iterator[str]:
        for rel, _size in self.bucket.listing():
            name = rel.rsplit("/", 1)[-1]
            if name.endswith(SUFFIX) and rel.count("/") == 1:
                yield name[: -len(SUFFIX)]

    def remove_unreferenced(self, referenced: set[str], dry_run: bool = False) -> tuple[int, int]:
        """Delete the objects no key of `referenced` names. Returns (objects, bytes)."""
        doomed = [
            (rel, size)
            for rel, size in self.bucket.listing()
            if not (rel.endswith(SUFFIX) and rel.rsplit("/", 1)[-1][: -len(SUFFIX)] in referenced)
        ]
        if not dry_run:
            self.bucket.delete(rel for rel, _ in doomed)
        return len(doomed), sum(size for _, size in doomed)

    def close(self) -> None:
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)


def _tree_bytes(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


# --- pruning: what the run's indexes no longer name ----------------------------------------


def _documents(states_dir: Path) -> Iterator[dict[str, Any]]:
    for doc in [states_dir / "index.json", *sorted(states_dir.glob(PART_GLOB))]:
        try:
            yield json.loads(doc.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            continue


def referenced_keys(states_dir: Path) -> set[str]:
    """The sample keys a hidden_states directory's index and part manifests name."""
    return {s["key"] for data in _documents(states_dir) for s in data.get("samples", []) if s.get("key")}


def bucket_stores(states_dir: Path) -> set[str]:
    """The bucket stores a hidden_states directory's index and part manifests name."""
    return {data["store"] for data in _documents(states_dir) if data.get("store")}


def prune_unreferenced(results: str | os.PathLike, dry_run: bool = False) -> list[tuple[Path | str, int, int]]:
    """Every sample store under `results`, and every bucket store a run's documents name: remove
    the samples that neither the index nor a part manifest of that run names. Returns (store,
    files, bytes) for each store touched."""
    out = []
    for store in sorted(Path(results).rglob(STORE_DIR)):
        if not store.is_dir() or not (store.parent / "index.json").exists() and not any(store.parent.glob(PART_GLOB)):
            continue  # no index or manifest: not a store a finished phase wrote, leave it
        files, nbytes = SampleStore(store).remove_unreferenced(referenced_keys(store.parent), dry_run)
        if files:
            out.append((store, files, nbytes))
    documents = [*Path(results).rglob("index.json"), *Path(results).rglob(PART_GLOB)]
    for states_dir in sorted({p.parent for p in documents}):
        for location in sorted(bucket_stores(states_dir)):
            files, nbytes = BucketSampleStore(location).remove_unreferenced(referenced_keys(states_dir), dry_run)
            if files:
                out.append((location, files, nbytes))
    return out
