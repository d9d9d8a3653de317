"""A job's finished outputs kept by the key of what made them: early cut-off.

Snakemake reruns a job when anything upstream was rewritten, even with the same bytes (a
generate whose code changed but whose requests did not), and when a setting that cannot
change the job's outputs changes. A job that computes a key over what really decides its
outputs (input contents, the settings that shape them, the code that computes them) finds
them here and links them back in seconds instead of loading the verifier again: shards,
drafts, benchmark measurements, parity replays.

Entries are hard links (no extra space; every write in eagleflow replaces a file by rename,
so a linked file is never changed in place) under `<dir>/<slot>.<key>/`, one entry per slot:
keeping a new key drops the slot's others.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from workflow_scripts.common.identity import content_digest, verifier_fingerprint


class OutputCache:
    """Outputs (files or directories, by name) of one slot (a shard, a draft, a variant's
    benchmark), by key, in directory `dir`."""

    def __init__(self, dir: str | os.PathLike, slot: str):
        self.dir = Path(dir)
        self.slot = slot

    def _entry(self, key: str) -> Path:
        return self.dir / f"{self.slot}.{key}"

    def restore(self, key: str, outputs: Mapping[str, str | os.PathLike]) -> bool:
        """Link the outputs kept under `key` back to their paths; False (nothing written) if
        there is no complete entry for `key`."""
        entry = self._entry(key)
        if not all((entry / name).exists() for name in outputs):
            return False
        for name, out in outputs.items():
            _link_into_place(entry / name, Path(out))
            # Snakemake plans a job again whose output is older than an input: a linked-back
            # output is as new as the job that restored it (every link of the file with it).
            _touch(Path(out))
        return True

    def keep(self, key: str, outputs: Mapping[str, str | os.PathLike]) -> None:
        """Link the finished `outputs` in under `key`, dropping the slot's entries of other keys."""
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
        _remove(entry)
        os.replace(tmp, entry)


def _link_tree(src: Path, dst: Path) -> None:
    """Hard-link file `src` (or every file under directory `src`) to `dst`."""
    if src.is_dir():
        dst.mkdir(parents=True)
        for child in sorted(src.iterdir()):
            _link_tree(child, dst / child.name)
    else:
        os.link(src, dst)


def _link_into_place(src: Path, out: Path) -> None:
    """Link `src` to `out` atomically: a temporary name next to it, then a rename."""
    tmp = out.with_name(f".{out.name}.restore.tmp")
    _remove(tmp)
    out.parent.mkdir(parents=True, exist_ok=True)
    _link_tree(src, tmp)
    if out.is_dir() and not out.is_symlink():
        shutil.rmtree(out)  # a directory cannot be renamed over one that has files
    os.replace(tmp, out)


def _touch(path: Path) -> None:
    for p in [path, *(sorted(path.rglob("*")) if path.is_dir() else [])]:
        os.utime(p)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def job_key(inputs: Mapping[str, Any], params: Mapping[str, Any]) -> str:
    """The key of a job's outputs: every input by content (the verifier, `inputs["verifier"]`,
    by its cheap fingerprint; the rest whole) and every param (the settings that shape the
    outputs and the `code` fingerprint of what computes them). Paths do not count."""
    parts: dict[str, Any] = {"params": dict(params)}
    for name, value in inputs.items():
        paths = value if isinstance(value, list | tuple) else [value]
        identity = verifier_fingerprint if name == "verifier" else content_digest
        parts[name] = [identity(p) for p in paths]
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def reuse_or_make(smk: Any, make: Callable[[], None], log: logging.Logger) -> None:
    """Run `make` (the job's body), unless a job of this rule with the same key (job_key of
    its inputs and params) finished before: then link its outputs back. Snakemake reruns a job
    whenever an input was rewritten, with the same bytes too; this makes that rerun cost
    seconds and no verifier load."""
    outputs = dict(smk.output.items())
    cache = OutputCache(Path(next(iter(outputs.values()))).parent / ".done", smk.rule)
    key = job_key(dict(smk.input.items()), dict(smk.params.items()))
    if cache.restore(key, outputs):
        log.info(
            "made from the same inputs, settings and code before (key %s): outputs linked back from %s", key, cache.dir
        )
        return
    make()
    cache.keep(key, outputs)
