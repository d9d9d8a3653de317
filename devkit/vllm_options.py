"""The options vLLM's OpenAI API server defines, read from its own parser, as
workflow/eagleflow/runtime/vllm_flags/options.json records them.

    python -m devkit.vllm_options [--write]

For each option, by its canonical (first long) name and in the parser's order: how many
values argparse takes after it (0, 1, or nargs '?', '+', '*'), its other spellings (short
flags, a BooleanOptionalAction's `--no-x`), whether its value is JSON, and whether every
occurrence adds a value (argparse's `append`). runtime.server_args rebuilds the parser from it
with the stdlib's argparse where vLLM is not importable (keys are computed while Snakemake
builds the DAG, on hosts where vLLM may be absent); which options can change a result is
eagleflow's own list (runtime/vllm_flags/run_only.yaml). Without --write, says whether the
recorded file is the installed vLLM's (tests/unit/test_server_args.py runs the check).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import Any

from eagleflow.common.atomic import write_text

OPTIONS = Path(__file__).resolve().parents[1] / "workflow/eagleflow/runtime/vllm_flags/options.json"


@functools.cache
def vllm_parser() -> argparse.ArgumentParser:
    """vLLM's own server parser (vllm.entrypoints.launchers.api_server.entry.main builds it so)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


def innermost_type(fn) -> str:
    """The function vLLM's optional_type/parse_type wrappers end in (their closures)."""
    while True:
        inner = [c.cell_contents for c in getattr(fn, "__closure__", None) or () if callable(c.cell_contents)]
        if not inner:
            return getattr(fn, "__name__", "")
        fn = inner[0]


def described(action: argparse.Action) -> tuple[str, dict[str, Any]]:
    """(canonical name, what options.json records of it), read from the option itself."""
    nargs = 0 if isinstance(action, argparse.BooleanOptionalAction) else action.nargs
    canonical = next(s for s in action.option_strings if s.startswith("--"))
    json_valued = innermost_type(action.type) in {"loads", "parse_dataclass", "union_dict_and_str"}
    json_valued |= type(action).__name__ == "LoRAParserAction"  # parses JSON items itself
    return canonical, {
        "arity": 1 if nargs is None else nargs,
        "aliases": [s for s in action.option_strings if s != canonical],
        "json": json_valued,
        "repeats": isinstance(action, argparse._AppendAction),
    }


def installed_options() -> dict[str, Any]:
    """options.json's content for the installed vLLM."""
    import vllm

    options = dict(described(a) for a in vllm_parser()._actions if a.option_strings)
    return {"vllm_version": vllm.__version__, "options": options}


def as_text(table: dict[str, Any]) -> str:
    """JSON with one option a line, so that a new vLLM's changes read as a diff."""
    rows = ",\n".join(f"  {json.dumps(name)}: {json.dumps(spec)}" for name, spec in table["options"].items())
    return f'{{"vllm_version": {json.dumps(table["vllm_version"])}, "options": {{\n{rows}\n}}}}\n'


def differences(recorded: dict[str, Any], installed: dict[str, Any]) -> dict[str, list[str]]:
    """The options vLLM's parser adds, drops or reads otherwise against the recorded file."""
    old, new = recorded["options"], installed["options"]
    return {
        "added": sorted(set(new) - set(old)),
        "dropped": sorted(set(old) - set(new)),
        "read otherwise": sorted(k for k in set(new) & set(old) if new[k] != old[k]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help=f"rewrite {OPTIONS.name} from the installed vLLM")
    args = parser.parse_args()
    installed = installed_options()
    if args.write:
        write_text(OPTIONS, as_text(installed))
        return 0
    changed = {what: names for what, names in differences(json.loads(OPTIONS.read_text()), installed).items() if names}
    print(
        f"{OPTIONS.name} {'is not' if changed else 'is'} vLLM {installed['vllm_version']}'s"
        + (f": {changed}" if changed else "")
    )
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
