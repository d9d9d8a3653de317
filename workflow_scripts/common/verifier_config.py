"""The verifier's language-model config, read as JSON (no remote code runs)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of a config dict: multimodal verifiers such as Kimi-K2.5
    nest it under `text_config`."""
    return config.get("text_config") or config


def read_text_config(model_dir: str | os.PathLike) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    try:
        return text_config(json.loads(path.read_text()))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read the verifier's config ({exc})") from exc
