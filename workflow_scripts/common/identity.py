"""Content identities of the files a stage reads, for the keys of its outputs: the verifier's
(cheap, for a terabyte checkpoint) and any file's or directory's (whole). Paths and mtimes do
not count: the same files elsewhere are the same inputs."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

# Files read whole into the verifier fingerprint; larger ones by name, size, head and tail.
SMALL_FILE_BYTES = 1 << 20
EDGE_BYTES = 1 << 20


def verifier_fingerprint(model_dir: str | os.PathLike) -> str:
    """A cheap content fingerprint of a model directory (symlinks followed).

    Config, tokenizer, chat template and custom code are hashed whole; weight files by name,
    size and their first and last MiB, which is seconds for a terabyte checkpoint. Copying or
    re-linking the same files keeps the fingerprint; mtimes do not count.
    """
    root = Path(model_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"verifier directory {root} does not exist (prepare_verifier makes it)")
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file() and not _ignored(p.relative_to(root))):
        size = path.stat().st_size
        h.update(f"{path.relative_to(root).as_posix()}\0{size}\0".encode())
        with open(path, "rb") as fh:
            if size <= SMALL_FILE_BYTES:
                h.update(fh.read())
            else:
                h.update(fh.read(EDGE_BYTES))
                fh.seek(size - EDGE_BYTES)
                h.update(fh.read(EDGE_BYTES))
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
        with open(file, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                h.update(block)
        h.update(b"\0")
    return h.hexdigest()[:32]
