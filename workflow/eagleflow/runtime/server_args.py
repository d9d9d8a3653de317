"""Which of the flags a vLLM server is launched with can change what it computes. Pure.

The launcher (runtime.spec) and this reader are run-only code, in no rule's fingerprint; the
argv the launcher builds reaches the result keys as data instead: the response store's key (generate) and the shard
cache's key (hidden_states, vllm backend) hold `result_args` of the argv a job launches, and
the rules' params hold the same list, computed from the same launcher while Snakemake builds
the DAG. A launcher change that adds or changes a flag of this kind restales what it changes;
one that only changes how the server runs restales nothing.

Which flag is which is runtime.vllm_flags' table. The argv is read as vLLM reads it, without
importing vLLM (keys are computed where it may be absent): FlexibleArgumentParser's rewrites
first (underscores, `-O3`, dotted JSON keys), then argparse's matching (short aliases,
`--x=v`, unique prefixes, `--no-x`, how many values each flag takes). What comes out is
canonical, so that spelling and order change no key: long names, one group per flag sorted
by name, the last occurrence of a flag winning as in argparse, JSON values with sorted keys.
Values are compared as given otherwise (`--max-model-len 4k` and `4000` are two keys: a
spurious recompute, never a wrong restore), and a flag whose value names a file (a chat
template, a tokenizer) is keyed by the name, not by the file's content.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from eagleflow.runtime.vllm_flags import FLAGS, RESULT, RUN_ONLY

# Every spelling vLLM accepts for an option (its canonical name, short aliases, `--no-x`),
# to the canonical name.
OPTION_NAMES: dict[str, str] = {alias: flag for flag, spec in FLAGS.items() for alias in (flag, *spec.aliases)}
# BooleanOptionalAction's negations, `--no-x` -> `--x`: the same setting, set to False.
NEGATIONS: dict[str, str] = {
    f"--no-{flag[2:]}": flag for flag, spec in FLAGS.items() if f"--no-{flag[2:]}" in spec.aliases
}
# The flags that only change how a server runs (derived from the table, the one list that
# decides: tests/unit/test_runtime_boundary.py). Every other flag counts, unknown ones too.
RUN_ONLY_FLAGS = frozenset(flag for flag, spec in FLAGS.items() if spec.kind == RUN_ONLY)

# argparse takes a token that looks like a negative number as a value, not a flag (vLLM has
# no option that looks like one): `--seed -1`.
_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")
# FlexibleArgumentParser's `-O <n>`: a separate level only for these values.
_O_LEVELS = frozenset({"0", "1", "2", "3"})


@dataclass(frozen=True)
class _Occurrence:
    """One flag as given: `key` is what later occurrences replace (the canonical name),
    `group` the canonical [flag, value...] it contributes."""

    key: str
    group: list[str]
    replaces: bool  # False for unknown and `append` flags: every occurrence counts


def server_args(argv: Sequence[str]) -> list[list[str]]:
    """[flag, value...] for each flag of a server's `argv`, as vLLM reads it: canonical long
    names (`-q` is `--quantization`, `--no-x` stays `--no-x`), sorted by flag, one group per
    flag (the last occurrence wins, as argparse keeps it; unknown and `append` flags keep
    every occurrence), JSON values canonical. Without the launcher before vLLM's flags.

    Defaults followed by overrides merge into one setting per flag: the overrides win."""
    args = list(argv)
    occurrences = _parse(_rewrite(args[_launcher_end(args) :]))
    latest: dict[str, int] = {o.key: i for i, o in enumerate(occurrences) if o.replaces}
    kept = [o for i, o in enumerate(occurrences) if not o.replaces or latest[o.key] == i]
    return [o.group for o in sorted(kept, key=lambda o: o.key)]


def result_args(argv: Sequence[str]) -> list[list[str]]:
    """server_args of `argv` that can change a reply or a state: all but the run-only ones."""
    return [g for g in server_args(argv) if is_result_flag(g[0])]


def is_result_flag(flag: str) -> bool:
    """Whether `flag` (any spelling vLLM accepts) can change a result; an unknown flag can."""
    spec = FLAGS.get(NEGATIONS.get(flag, OPTION_NAMES.get(flag, flag)))
    return spec is None or spec.kind == RESULT


def _launcher_end(args: list[str]) -> int:
    """Where vLLM's own arguments begin. What comes after `python ... -m MODULE` is the
    module's, and what comes after `vllm serve` the subcommand's, less a positional model
    tag first (`vllm serve MODEL`, run-only as --model is). Another launcher (srun, docker,
    a user's server.command) may have options of its own: there vLLM's arguments begin at
    the first long flag (the launcher's argv always continues with `--model`)."""
    first_long = next((i for i, a in enumerate(args) if a.startswith("--")), len(args))
    before = args[:first_long]
    if "-m" in before:
        start = before.index("-m") + 2
    elif "serve" in before:
        start = before.index("serve") + 1
    else:
        return first_long
    return next((i for i in range(start, len(args)) if args[i].startswith("-")), len(args))


# FlexibleArgumentParser.parse_args (vllm/utils/argparse_utils.py) rewrites the argv before
# argparse sees it; mirrored here, quirks included.


def _rewrite(args: list[str]) -> list[str]:
    """The argv argparse gets from FlexibleArgumentParser: `--help=x` is `--help`;
    underscores in a long flag's name are dashes (up to a `.` or `=`: `--max_model_len` is
    `--max-model-len`); `-O3`, `-O=3`, `-Ox` are `--optimization-level 3` / `x`, and `-O N`
    too for N in 0..3; dotted keys merge into JSON values (_merge_dotted)."""
    if "--config" in args:
        # vLLM splices in the flags of a YAML file here; a key cannot see them.
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
            out.append(_dashed(name) + eq + value)
        elif arg.startswith("-O") and arg != "-O":
            # `-O.mode=3` becomes `--optimization-level .mode=3`, as in vLLM.
            out += ["--optimization-level", arg[3:] if arg[2] == "=" else arg[2:]]
        elif arg == "-O" and i + 1 < len(args) and args[i + 1] in _O_LEVELS:
            out.append("--optimization-level")
        else:
            out.append(arg)
    return _merge_dotted(out)


def _dashed(name: str) -> str:
    """`--a_b.c_d` -> `--a-b.c_d`: vLLM replaces underscores from after `--` to the first
    `.`; the dotted keys after it are JSON keys, kept as given."""
    head, dot, rest = name[2:].partition(".")
    return "--" + head.replace("_", "-") + dot + rest


def _merge_dotted(args: list[str]) -> list[str]:
    """FlexibleArgumentParser's dotted JSON keys: `--cc.mode 3` and `--cc.mode=3` set key
    `mode` of a dict for `--cc`, `--x.list+ a,b` appends to a list; every dict of a flag
    (as spelled: `-cc` and `--compilation-config` collect apart) is then appended to the
    argv as one JSON value, after every other argument, so it replaces a JSON value given
    for the same flag anywhere (argparse keeps the last)."""
    dicts: dict[str, dict[str, Any]] = {}
    out: list[str] = []
    skip = False
    for i, arg in enumerate(args):
        if skip:
            skip = False
            continue
        if not (arg.startswith("-") and "." in arg):
            out.append(arg)
            continue
        if "=" in arg:
            path, value = arg.split("=", 1)
            if "." not in path:  # the `.` was in the value: `--x=1.5`
                out.append(arg)
                continue
        else:
            # Taken whatever it looks like (`-0.5` is a dotted key of `-0` here, as in vLLM).
            if i + 1 == len(args):
                raise ValueError(f"server argv: {arg} (a dotted JSON key) has no value")
            path, value, skip = arg, args[i + 1], True
        if path.endswith("+"):
            path, value = path[:-1], json.dumps(value.split(","))
        flag, *keys = path.split(".")
        _merge(dicts.setdefault(flag, {}), _nested(keys, _dotted_value(value)))
    for flag, value in dicts.items():
        out += [flag, json.dumps(value)]
    return out


def _dotted_value(text: str) -> Any:
    """A dotted key's value: JSON, else a human-readable integer (`80g`), else the text."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        try:
            return _human_readable_int(text)
        except ValueError:
            return text


def _human_readable_int(text: str) -> int:
    """vllm.utils.argparse_utils.human_readable_int: `1k` is 1000, `1K` 1024, `25.6k` 25600."""
    text = text.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", text)
    if not match:
        return int(text)
    number, suffix = match.groups()
    if suffix in "kmgt":
        return int(float(number) * 10 ** (3 * ("kmgt".index(suffix) + 1)))
    return int(number) * 2 ** (10 * ("KMGT".index(suffix) + 1))  # no decimals: ValueError


def _nested(keys: list[str], value: Any) -> Any:
    """keys a, b and value v -> {"a": {"b": v}}."""
    for key in reversed(keys):
        value = {key: value}
    return value


def _merge(into: dict[str, Any], update: dict[str, Any]) -> None:
    """vLLM's recursive_dict_update: dicts merge, lists concatenate, anything else replaces."""
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        elif isinstance(value, list) and isinstance(into.get(key), list):
            into[key] += value
        else:
            into[key] = value


# argparse (Python 3.11's ArgumentParser._parse_optional and _get_option_tuples) on the
# rewritten argv: which tokens are flags, which flag each names, which values it takes.


@dataclass(frozen=True)
class _Option:
    """A token argparse reads as a flag: the option string it names (for a flag the table
    does not know, the token up to `=`), and a value given with it (`--x=v`, `-qfp8`)."""

    name: str
    given: str | None
    known: bool


def _parse(tokens: list[str]) -> list[_Occurrence]:
    """Each flag of `tokens` in order, with the values argparse gives it. vLLM takes one
    positional, the model tag, which this project never passes after flags: a token no flag
    takes is refused (it is mostly a value given to a flag that takes none)."""
    occurrences: list[_Occurrence] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token == "--":  # argparse: only positionals follow
            if i + 1 < len(tokens):
                raise _positional_error(tokens[i + 1], "--")
            break
        option = _option(token)
        if option is None:
            raise _positional_error(token, tokens[i - 1] if i else None)
        values, i = _values(option, tokens, i + 1)
        occurrences.append(_occurrence(option, values))
    return occurrences


def _positional_error(token: str, after: str | None) -> ValueError:
    """The error for a token argparse would take as vLLM's positional model tag."""
    where = f" after {after}" if after else ""
    return ValueError(
        f"server argv: {token!r}{where} is no flag's value (that flag takes none, or fewer); "
        "vLLM would read it as the model tag"
    )


def _option(token: str) -> _Option | None:
    """The flag `token` names, or None for a token argparse reads as a value."""
    if not token.startswith("-") or token == "-":
        return None
    if token in OPTION_NAMES:
        return _Option(token, None, known=True)
    name, eq, value = token.partition("=")
    if eq and name in OPTION_NAMES:
        return _Option(name, value, known=True)
    matches = _abbreviations(token)
    if len(matches) > 1:
        options = ", ".join(m.name for m in matches)
        raise ValueError(f"server argv: {token} is ambiguous, vLLM could read it as any of {options}")
    if matches:
        return matches[0]
    if _NEGATIVE_NUMBER.match(token) or " " in token:
        return None
    return _Option(name, value if eq else None, known=False)


def _abbreviations(token: str) -> list[_Option]:
    """argparse's allow_abbrev (on in vLLM): a long flag's unique prefix names it
    (`--max-model 4096`); a single-dash token is a short option's prefix (`-s` is `-sc`) or
    a one-letter option with its value attached (`-qfp8` is `-q fp8`)."""
    if token.startswith("--"):
        prefix, eq, value = token.partition("=")
        return [_Option(o, value if eq else None, known=True) for o in OPTION_NAMES if o.startswith(prefix)]
    short = token[:2]
    return [
        _Option(o, token[2:] if o == short else None, known=True)
        for o in OPTION_NAMES
        if o == short or o.startswith(token)
    ]


def _values(option: _Option, tokens: list[str], i: int) -> tuple[list[str], int]:
    """The values `option` takes from `tokens[i:]`, and the index after them. As argparse's
    nargs: a value given with the flag is its only one; otherwise arity 1 takes the next
    token, '?' the next if it is a value, '+' and '*' every value up to the next flag. A flag
    the table does not know takes every value up to the next flag."""
    arity = FLAGS[OPTION_NAMES[option.name]].arity if option.known else "*"
    if arity == 0:
        if option.given is not None:
            raise ValueError(f"server argv: {option.name} takes no value, got {option.given!r}")
        return [], i
    if option.given is not None:
        return [option.given], i
    if arity in (1, "?"):
        if i < len(tokens) and _is_value(tokens[i]):
            return [tokens[i]], i + 1
        if arity == 1:
            raise ValueError(f"server argv: {option.name} expects a value")
        return [], i
    end = i
    while end < len(tokens) and _is_value(tokens[end]):
        end += 1
    if arity == "+" and end == i:
        raise ValueError(f"server argv: {option.name} expects one or more values")
    return tokens[i:end], end


def _is_value(token: str) -> bool:
    """Whether argparse reads `token` as a value rather than a flag."""
    return token != "--" and _option(token) is None


def _occurrence(option: _Option, values: list[str]) -> _Occurrence:
    """The canonical group of one flag as given. A `--no-x` stays itself (the value False
    of `--x`, which it replaces); an unknown flag is kept as given, every occurrence."""
    if not option.known:
        return _Occurrence(option.name, [option.name, *values], replaces=False)
    canonical = OPTION_NAMES[option.name]
    spec = FLAGS[canonical]
    flag = option.name if option.name in NEGATIONS else canonical
    return _Occurrence(canonical, [flag, *(_canonical_json(v) if spec.json else v for v in values)], not spec.repeats)


def _canonical_json(value: str) -> str:
    """A JSON object or list with sorted keys and no spaces, so that `{"a":1,"b":2}` and
    `{"b": 2, "a": 1}` are one key; any other value as given."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        return value
    if not isinstance(parsed, dict | list):
        return value
    return json.dumps(parsed, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
