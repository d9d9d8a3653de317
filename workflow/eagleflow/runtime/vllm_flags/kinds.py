"""The kinds of vLLM options (runtime.vllm_flags): result or run-only, and how argparse reads them."""

from __future__ import annotations

from typing import Literal, NamedTuple

RESULT: Literal["result"] = "result"
RUN_ONLY: Literal["run-only"] = "run-only"

FlagClass = Literal["result", "run-only"]
# How many values argparse takes after the flag: 0 (store_true, BooleanOptionalAction), 1,
# or nargs '?', '+', '*'.
Arity = Literal[0, 1, "?", "+", "*"]


class Flag(NamedTuple):
    """One option of vLLM's server, under its canonical (first long) name."""

    kind: FlagClass
    arity: Arity
    # Its other spellings: short flags (`-tp`) and a BooleanOptionalAction's `--no-x`.
    aliases: tuple[str, ...] = ()
    # The value is JSON (vLLM parses it as a dict or list): keys compare it canonicalized.
    json: bool = False
    # argparse's `append`: every occurrence adds a value instead of replacing the last one.
    repeats: bool = False
