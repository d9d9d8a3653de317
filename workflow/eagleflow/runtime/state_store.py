"""The hidden states of a run kept per sample, by key (the keys: hidden_states.sample_keys).

Layout: `<run>/hidden_states/samples/<key[:2]>/<key>.safetensors`, each a shard of one sample
(hidden_states.shard_file), written atomically and read-only once written. A job killed
mid-phase leaves whole files only; its rerun finds them. One key is one file, so nothing is
stored twice; where two jobs extract the same sample, the first writer's file stands (the job
skips a key stored meanwhile). What neither the index nor a part manifest (or a running
job's pending list) beside the store names is removed by
`python -m eagleflow.runtime.output_cache prune` (prune_unreferenced); run it when no job runs.

Run-only: where states lie and when they are dropped, never what they hold.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

SUFFIX = ".safetensors"
STORE_DIR = "samples"  # beside index.json: results/<run>/hidden_states/samples/
PART_GLOB = "part-*.json"


def relative_path(key: str) -> str:
    """Where a sample's file lies under its store. Pure."""
    return f"{key[:2]}/{key}{SUFFIX}"


class SampleStore:
    """A directory of samples' states by key (the module's docstring)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    def path(self, key: str) -> Path:
        return self.root / relative_path(key)

    def has(self, key: str) -> bool:
        return self.path(key).is_file()

    def seal(self, key: str) -> None:
        """Make a stored sample read-only: nothing edits states in place."""
        p = self.path(key)
        p.chmod(p.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))

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


def referenced_keys(states_dir: Path) -> set[str]:
    """The sample keys a hidden_states directory's index and part manifests name."""
    keys: set[str] = set()
    for doc in [states_dir / "index.json", *sorted(states_dir.glob(PART_GLOB))]:
        try:
            data = json.loads(doc.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            continue
        keys.update(s["key"] for s in data.get("samples", []) if s.get("key"))
    return keys


def prune_unreferenced(results: str | os.PathLike, dry_run: bool = False) -> list[tuple[Path, int, int]]:
    """Every sample store under `results`: remove the samples that neither the index nor a
    part manifest beside it names. Returns (store, files, bytes) for each store touched."""
    out = []
    for store in sorted(Path(results).rglob(STORE_DIR)):
        if not store.is_dir() or not (store.parent / "index.json").exists() and not any(store.parent.glob(PART_GLOB)):
            continue  # no index or manifest: not a store a finished phase wrote, leave it
        files, nbytes = SampleStore(store).remove_unreferenced(referenced_keys(store.parent), dry_run)
        if files:
            out.append((store, files, nbytes))
    return out
