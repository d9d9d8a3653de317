"""Training's checkpoints copied to a bucket (`storage.checkpoints`; under
`--default-storage-provider s3` the run's prefix), so that a train job resubmitted to a node
without them resumes from the newest (docs/operations.md, "Checkpoints in a bucket"). Run-only:
where a checkpoint is kept changes no byte of the draft."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from eagleflow.common.atomic import atomic_path
from eagleflow.runtime.object_store import Bucket

log = logging.getLogger(__name__)


class BucketCheckpoints:
    """A fingerprint directory's checkpoints (train/checkpoint.py: `step-NNNNNNNN/`, whose names
    sort by step) mirrored in a bucket: each copied there once written, its `state.json` last (a
    checkpoint in the bucket is whole once that object is); the newest fetched back where the
    job's own directory lacks it."""

    STATE = "state.json"
    # train/checkpoint.py's PREFIX, by value: runtime imports no stage module
    # (tests/unit/test_runtime_boundary.py; tests/unit/test_checkpoint_mirror.py checks the two agree).
    STEP = "step-"

    def __init__(self, url: str):
        self.bucket = Bucket(url)

    @classmethod
    def for_job(cls, storage: dict[str, Any] | None, directory: Path) -> BucketCheckpoints | None:
        """The mirror of `directory` (relative to the run's working directory, as the rule
        names it) under `storage.checkpoints`, or None where that is not set."""
        where = (storage or {}).get("checkpoints")
        return cls(f"{where.rstrip('/')}/{directory.as_posix().lstrip('/')}") if where else None

    def whole(self, listing: list[tuple[str, int]] | None = None) -> list[str]:
        """The checkpoints the bucket holds whole, oldest first (from `listing` where given, else
        from a listing of the bucket)."""
        return sorted(
            rel.split("/", 1)[0]
            for rel, _size in (self.bucket.listing() if listing is None else listing)
            if rel.startswith(self.STEP) and rel.endswith("/" + self.STATE) and rel.count("/") == 1
        )

    def publish(self, path: Path, keep: int) -> None:
        """Copy checkpoint `path` to the bucket, then drop all there but the newest `keep`."""
        for f in sorted(path.iterdir(), key=lambda f: f.name == self.STATE):
            self.bucket.put(f"{path.name}/{f.name}", f)
        listing = list(self.bucket.listing())
        kept = set(self.whole(listing)[-keep:])
        self.bucket.delete(rel for rel, _size in listing if rel.split("/", 1)[0] not in kept)
        log.info("checkpoint %s copied to %s", path.name, self.bucket.url)

    def fetch_newest(self, directory: Path, have: list[str]) -> Path | None:
        """The newest whole checkpoint of the bucket, downloaded into `directory` (atomically)
        unless one of `have` (the names of the checkpoints `directory` holds) is as new; its
        path, or None."""
        found = self.whole()
        if not found or any(name >= found[-1] for name in have):
            return None
        newest = found[-1]
        directory.mkdir(parents=True, exist_ok=True)
        with atomic_path(directory / newest) as tmp:
            tmp.mkdir()
            for rel, _size in list(self.bucket.listing(newest + "/")):
                self.bucket.download(rel, tmp / rel.split("/", 1)[1])
        log.info("checkpoint %s fetched from %s", newest, self.bucket.url)
        return directory / newest

    def drop(self) -> None:
        """Delete every object of the mirror: training is complete, its outputs written."""
        self.bucket.delete(rel for rel, _size in list(self.bucket.listing()))
