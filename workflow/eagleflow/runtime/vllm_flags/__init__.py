"""Every option vLLM's OpenAI API server defines, and whether it can change what the server
computes, without importing vLLM (keys are computed while Snakemake builds the DAG, where vLLM
may be absent). How each option is read is vLLM's own parser's answer, options.json, recorded
by `python -m devkit.vllm_options --write` (tests/unit/test_server_args.py fails when the
installed vLLM's parser says otherwise); which options only change how a server runs is
eagleflow's list, run_only.yaml (the policy: docs/invalidation.md); every other is a RESULT."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal, NamedTuple

import yaml

RESULT: Literal["result"] = "result"
RUN_ONLY: Literal["run-only"] = "run-only"


class Flag(NamedTuple):
    """One option of vLLM's server: its kind; how many values argparse takes after it (0, 1, or
    nargs '?', '+', '*'); its other spellings (`-tp`, a BooleanOptionalAction's `--no-x`); whether
    its value is JSON (keys compare it canonicalized); whether each occurrence adds a value."""

    kind: Literal["result", "run-only"]
    arity: Literal[0, 1, "?", "+", "*"]
    aliases: tuple[str, ...] = ()
    json: bool = False
    repeats: bool = False


_RECORDED = json.loads(Path(__file__).with_name("options.json").read_text())
VLLM_VERSION: str = _RECORDED["vllm_version"]
RUN_ONLY_OPTIONS = frozenset(
    flag for group in yaml.safe_load(Path(__file__).with_name("run_only.yaml").read_text()).values() for flag in group
)
# Every option, by its canonical (first long) name, in the parser's order.
FLAGS: dict[str, Flag] = {
    name: Flag(RUN_ONLY if name in RUN_ONLY_OPTIONS else RESULT, **spec | {"aliases": tuple(spec["aliases"])})
    for name, spec in _RECORDED["options"].items()
}
