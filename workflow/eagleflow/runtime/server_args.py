"""Which of the flags a vLLM server is launched with can change what it computes. Pure.

Run-only code, in no rule's fingerprint: the argv a job launches reaches the result keys as
data instead (its `result_args` in generate's store key, the vllm backend's shard-cache key,
the rules' params), read as vLLM reads it without importing vLLM (keys are computed where it
may be absent): FlexibleArgumentParser's rewrites, then argparse with vLLM's options as
runtime.vllm_flags records them. Spelling and order change no key; values count as given
(`--max-model-len 4k` and `4000` are two keys: a spurious recompute, never a wrong restore)."""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import re
from collections.abc import Sequence
from typing import Any

from eagleflow.runtime.vllm_flags import FLAGS, RUN_ONLY

# The flags that only change how a server runs; every other flag counts, unknown ones too. A
# group of server_args names one by its canonical name or its `--no-x`, both among its spellings.
RUN_ONLY_FLAGS = frozenset(flag for flag, spec in FLAGS.items() if spec.kind == RUN_ONLY)
_RUN_ONLY_SPELLINGS = frozenset(spelling for flag in RUN_ONLY_FLAGS for spelling in (flag, *FLAGS[flag].aliases))
# A flag the table does not know (a newer vLLM's) reaches argparse after a NUL, as a value of one of these
# options (`--x` takes the values up to the next flag, `--x=v` one): no argv token holds a NUL or abbreviates them.
_UNKNOWN, _UNKNOWN_GIVEN = "--\0unknown", "--\0unknown="


def server_args(argv: Sequence[str]) -> list[list[str]]:
    """[flag, value...] for each flag of a server's `argv` (without the launcher before vLLM's
    flags), as vLLM reads it: canonical long names (`-q` is `--quantization`, `--no-x` stays
    `--no-x`), sorted, one group per flag (the last occurrence wins, as argparse keeps it, so
    overrides after defaults win; unknown and `append` flags keep each), JSON canonical."""
    args = list(argv)
    settings = _read(_rewrite(args[_launcher_end(args) :]))
    return [group for _, groups in sorted(settings.items()) for group in groups]


def result_args(argv: Sequence[str]) -> list[list[str]]:
    """server_args of `argv` that can change a reply or a state: all but the run-only ones."""
    return [group for group in server_args(argv) if group[0] not in _RUN_ONLY_SPELLINGS]


def _launcher_end(args: list[str]) -> int:
    """Where vLLM's own arguments begin: after `python ... -m MODULE`, or `vllm serve` and a
    model tag (run-only, as --model is). Another launcher (srun, docker, a user's command) may
    have options of its own: there at the first long flag (the argv goes on with `--model`)."""
    first_long = next((i for i, a in enumerate(args) if a.startswith("--")), len(args))
    before = args[:first_long]
    if "-m" in before:
        start = before.index("-m") + 2
    elif "serve" in before:
        start = before.index("serve") + 1
    else:
        return first_long
    return next((i for i in range(start, len(args)) if args[i].startswith("-")), len(args))


def _rewrite(args: list[str]) -> list[str]:
    """The argv argparse gets from FlexibleArgumentParser.parse_args (vllm/utils/argparse_utils.py),
    quirks included: `--help=x` is `--help`; a long flag's underscores are dashes up to a `.`
    or `=`; `-O3`, `-O=3`, `-Ox`, `-O.mode=3` are `--optimization-level 3`, `x`, `.mode=3`,
    and `-O N` too for N in 0..3; dotted keys merge into JSON values (_merge_dotted)."""
    if "--config" in args:  # vLLM splices in the flags of a YAML file here
        raise ValueError(
            "server argv: --config reads flags from a file, which no cache key can see; "
            "list them in server.extra_args instead"
        )
    out: list[str] = []
    for i, arg in enumerate(args):
        if arg.startswith("--help="):
            out.append("--help")
        elif arg.startswith("--"):
            name, eq, value = arg.partition("=")
            head, dot, keys = name[2:].partition(".")
            out.append("--" + head.replace("_", "-") + dot + keys + eq + value)
        elif arg.startswith("-O") and arg != "-O":
            out += ["--optimization-level", arg[3:] if arg[2] == "=" else arg[2:]]
        elif arg == "-O" and args[i + 1 : i + 2] in (["0"], ["1"], ["2"], ["3"]):  # no other level
            out.append("--optimization-level")
        else:
            out.append(arg)
    return _merge_dotted(out)


def _merge_dotted(args: list[str]) -> list[str]:
    """FlexibleArgumentParser's dotted JSON keys: `--cc.mode 3` and `--cc.mode=3` set key `mode`
    of a dict for `--cc`, `--x.list+ a,b` appends to a list; each flag's dict (as spelled: `-cc`
    and `--compilation-config` collect apart) goes after every other argument as one JSON value,
    so it replaces a JSON value given for the flag anywhere (argparse keeps the last)."""
    dicts: dict[str, dict[str, Any]] = {}
    out: list[str] = []
    tokens = iter(args)
    for arg in tokens:
        path, eq, value = arg.partition("=")
        if not arg.startswith("-") or "." not in path:  # `--x=1.5`: the `.` is the value's
            out.append(arg)
            continue
        value = value if eq else next(tokens, None)  # whatever it looks like, as in vLLM
        if value is None:
            raise ValueError(f"server argv: {arg} (a dotted JSON key) has no value")
        if path.endswith("+"):
            path, value = path[:-1], json.dumps(value.split(","))
        flag, *keys = path.split(".")
        nested = functools.reduce(lambda inner, key: {key: inner}, reversed(keys), _dotted_value(value))
        _merge(dicts.setdefault(flag, {}), nested)
    return out + [a for flag, value in dicts.items() for a in (flag, json.dumps(value))]


def _dotted_value(text: str) -> Any:
    """JSON, else vLLM's human_readable_int (`1k` 1000, `1K` 1024, `2.5k` 2500), else the text."""
    with contextlib.suppress(json.JSONDecodeError):
        return json.loads(text)
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgt])|(\d+)([KMGT])", text.strip())
    with contextlib.suppress(ValueError):
        if match is None:
            return int(text)
        if match[2]:
            return int(float(match[1]) * 10 ** (3 * ("kmgt".index(match[2]) + 1)))
        return int(match[3]) * 2 ** (10 * ("KMGT".index(match[4]) + 1))
    return text


def _merge(into: dict[str, Any], update: dict[str, Any]) -> None:
    """vLLM's recursive_dict_update: dicts merge, lists concatenate, anything else replaces."""
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        elif isinstance(value, list) and isinstance(into.get(key), list):
            into[key] += value
        else:
            into[key] = value


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:
        raise ValueError(f"server argv: {message} (vLLM's parser refuses it too)")


class _Noted(argparse.Action):
    """Sets a flag's canonical [flag, value...] under its canonical name: `--no-x` stays itself
    (the value False of `--x`, which it replaces); an `append` or unknown flag adds one each time."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        values = [] if values is None else [values] if isinstance(values, str) else values
        if self.dest == _UNKNOWN:  # as given
            group = [*values[0][1:].split("=", 1), *values[1:]]
            flag, repeats = group[0], True
        else:
            flag, spec = self.dest, FLAGS[self.dest]
            negation, repeats = option_string == f"--no-{flag[2:]}", spec.repeats
            group = [option_string if negation else flag, *(_canonical_json(v) if spec.json else v for v in values)]
        setattr(namespace, flag, [*getattr(namespace, flag, []), group] if repeats else [group])


@functools.cache
def _parser() -> _Parser:
    """vLLM's server parser from options.json: argparse reads which tokens are flags, which flag
    each names (spellings, unique prefixes as vLLM allows, `--x=v`, `--no-x`), which values."""
    parser = _Parser(add_help=False, allow_abbrev=True)
    for flag, spec in FLAGS.items():
        nargs = {0: 0, 1: None}.get(spec.arity, spec.arity)  # type: ignore[call-overload]
        parser.add_argument(flag, *spec.aliases, nargs=nargs, action=_Noted, dest=flag, default=argparse.SUPPRESS)
    parser.add_argument(_UNKNOWN, nargs="+", action=_Noted, dest=_UNKNOWN, default=argparse.SUPPRESS)
    parser.add_argument(_UNKNOWN_GIVEN, action=_Noted, dest=_UNKNOWN, default=argparse.SUPPRESS)
    return parser


def _parse(tokens: list[str]) -> tuple[dict[str, list[list[str]]], list[str]]:
    """The settings argparse reads in `tokens`, and the tokens it gives no flag."""
    namespace, left = _parser().parse_known_args(tokens, argparse.Namespace())
    return vars(namespace), left


def _read(argv: list[str]) -> dict[str, list[list[str]]]:
    """The settings of `argv`. vLLM's one positional, the model tag, is never passed after
    flags here: a token no flag takes is refused (mostly a value to a flag that takes none)."""
    end = argv.index("--") if "--" in argv else len(argv)  # argparse: only positionals follow
    given = argv[:end]
    # Of the tokens argparse leaves, those it reads as flags rather than values (`-1`, `-x y`).
    unknown = {t for t in _parse(given)[1] if _parse([_UNKNOWN, "\0", t])[1]}
    tokens = [m for t in given for m in ((_UNKNOWN_GIVEN if "=" in t else _UNKNOWN, "\0" + t) if t in unknown else [t])]
    settings, left = _parse(tokens)
    if left:
        # The first token left ends the shortest prefix that leaves one (a NUL after it feeds a flag cut off there).
        i = next(i for i in range(len(tokens)) if {*_parse([*tokens[: i + 1], "\0"])[1]} - {"\0"})
        raise _stray(tokens[i], tokens[i - 1].lstrip("\0") if i else None)
    if end + 1 < len(argv):
        raise _stray(argv[end + 1], "--")
    return settings


def _stray(token: str, after: str | None) -> ValueError:
    where = f" after {after}" if after else ""
    return ValueError(
        f"server argv: {token!r}{where} is no flag's value (that flag takes none, or fewer); "
        "vLLM would read it as the model tag"
    )


def _canonical_json(value: str) -> str:
    """A JSON object or list with sorted keys and no spaces, so that spacing and key order change no key."""
    with contextlib.suppress(json.JSONDecodeError):
        parsed = json.loads(value)
        if isinstance(parsed, dict | list):
            return json.dumps(parsed, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return value
