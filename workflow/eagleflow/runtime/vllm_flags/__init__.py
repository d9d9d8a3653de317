"""Every option vLLM's OpenAI API server defines, and whether it can change what the server
computes. Keys are computed while Snakemake builds the DAG, on hosts where vLLM may be absent
or slow to import, so nothing here imports it:

- how each option is read (its arity, spellings, JSON value, `append`) is vLLM's own parser's
  answer, recorded in options.json by `python -m devkit.vllm_options --write` (vLLM's
  version is in the file; tests/unit/test_server_args.py fails when the installed vLLM's
  parser says otherwise, so a new vLLM is one command and a review of its new options);
- which options only change how a server runs is eagleflow's list (run_only.py); every other
  option is a RESULT. runtime.server_args parses a server's argv with this table; a flag the
  table does not know counts as a RESULT.

The policy (docs/invalidation.md): a key holds every input that can change an output's bytes
or its numerics beyond the project's tolerance (RESULT), and nothing that only changes
capacity, placement or how the server is operated (RUN_ONLY).
"""

from __future__ import annotations

import json
from pathlib import Path

from eagleflow.runtime.vllm_flags.kinds import RESULT, RUN_ONLY, Arity, Flag, FlagClass
from eagleflow.runtime.vllm_flags.run_only import RUN_ONLY_OPTIONS

__all__ = ["FLAGS", "RESULT", "RUN_ONLY", "VLLM_VERSION", "Arity", "Flag", "FlagClass"]

_RECORDED = json.loads((Path(__file__).parent / "options.json").read_text())
VLLM_VERSION: str = _RECORDED["vllm_version"]

# Every option, by its canonical (first long) name, in the parser's order.
FLAGS: dict[str, Flag] = {
    name: Flag(
        RUN_ONLY if name in RUN_ONLY_OPTIONS else RESULT,
        spec["arity"],
        tuple(spec["aliases"]),
        spec["json"],
        spec["repeats"],
    )
    for name, spec in _RECORDED["options"].items()
}
