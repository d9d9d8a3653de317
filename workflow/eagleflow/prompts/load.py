"""prompts: load a prompt set, normalise it, and split it into train and held-out eval prompts.

A prompt is a conversation skeleton: an optional system message and one or more user turns.
The verifier writes every assistant turn itself (synth). Accepted input rows (JSONL, gzipped
or not, or Parquet) carry `id` (optional), and either `turns` (list of user messages), `prompt`
(one user message) or `messages` (OpenAI format; assistant messages are dropped because
the verifier regenerates them). The split is a pure function of the conversation text, so
it is stable across runs and machines, and train and eval never share a conversation.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from eagleflow.common.fingerprint import stable_fraction

log = logging.getLogger(__name__)


def normalise(row: dict[str, Any], where: str) -> dict[str, Any]:
    """One prompt row in the canonical form {id, category, system, turns}."""
    system = row.get("system")
    if "turns" in row:
        turns = row["turns"]
    elif "prompt" in row:
        turns = [row["prompt"]]
    elif "messages" in row:
        msgs = row["messages"]
        if isinstance(msgs, str):
            msgs = json.loads(msgs)
        turns = [m["content"] for m in msgs if m.get("role") == "user"]
        system = next((m["content"] for m in msgs if m.get("role") == "system"), system)
    else:
        raise ValueError(f"{where}: a prompt needs `turns`, `prompt` or `messages`; got keys {sorted(row)}")
    if isinstance(turns, str) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise ValueError(f"{where}: `turns` must be a non-empty list of non-empty strings")
    key = conversation_key(system, turns)
    return {
        "id": str(row.get("id") or f"p-{key[:12]}"),
        "category": row.get("category") or "unknown",
        "system": system,
        "turns": list(turns),
    }


def conversation_key(system: str | None, turns: list[str]) -> str:
    text = json.dumps({"system": system, "turns": [t.strip() for t in turns]}, ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def load_prompts(path: str | os.PathLike) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompts.source {path} does not exist")
    return [normalise(row, f"{path} row {i}") for i, (_, row) in enumerate(numbered_rows(path), 1)]


def numbered_rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, row) of a JSONL file (gzipped by suffix) or (row number, row) of a Parquet file."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        yield from enumerate(pq.read_table(path).to_pylist(), 1)
        return
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not valid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{n}: a row must be a JSON object, got {type(row).__name__}")
            yield n, row


def split_prompts(prompts: list[dict[str, Any]], eval_fraction: float, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Deduplicate by conversation text and split by a hash of it. Pure."""
    seen_keys: set[str] = set()
    seen_ids: set[str] = set()
    train, evals = [], []
    for p in prompts:
        key = conversation_key(p["system"], p["turns"])
        if key in seen_keys:
            continue
        if p["id"] in seen_ids:
            raise ValueError(f"prompt id {p['id']!r} is used by two different conversations")
        seen_keys.add(key)
        seen_ids.add(p["id"])
        (evals if stable_fraction(seed, key) < eval_fraction else train).append(p)
    return train, evals
