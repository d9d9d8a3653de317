"""Every option vLLM's OpenAI API server defines, and whether it can change what the server
computes. Pure data: keys are computed while Snakemake builds the DAG, on hosts where vLLM
may be absent or slow to import, so nothing here imports it.

The policy (docs/invalidation.md): a key holds every input that can change an output's bytes
or its numerics beyond the project's tolerance (RESULT), and nothing that only changes
capacity, placement or how the server is operated (RUN_ONLY). When it is unclear whether a
flag changes numerics it is a RESULT: a spurious recompute costs time, a wrong restore costs
correctness. common.server_args parses a server's argv with this table; a flag the table
does not know counts as a RESULT.

Made from vLLM 0.32.0's parser (vllm.entrypoints.launchers.cli_args.make_arg_parser on
a FlexibleArgumentParser), grouped as its argument groups are, in its order.
tests/unit/test_server_args.py reads the installed vLLM's parser and fails on a flag this
table does not classify, on an arity or alias that disagrees, and on a flag vLLM no longer
defines; classify new flags here by the group's rule.
"""

from __future__ import annotations

from eagleflow.common.vllm_flags.engine import (
    CACHE,
    COMPILATION,
    ENGINE,
    KERNEL,
    LOGGING,
    LORA,
    MULTIMODAL,
    OBSERVABILITY,
    OFFLOAD,
    PARALLEL,
    SCHEDULER,
)
from eagleflow.common.vllm_flags.frontend import (
    ATTENTION,
    FRONTEND,
    LOAD,
    MAMBA,
    MODEL,
    SERVER,
    STRUCTURED_OUTPUTS,
)
from eagleflow.common.vllm_flags.kinds import RESULT, RUN_ONLY, Arity, Flag, FlagClass

__all__ = ["FLAGS", "RESULT", "RUN_ONLY", "VLLM_VERSION", "Arity", "Flag", "FlagClass"]

VLLM_VERSION = "0.32.0"

# Every option, by its canonical (first long) name.
FLAGS: dict[str, Flag] = {
    **SERVER,
    **FRONTEND,
    **MODEL,
    **LOAD,
    **ATTENTION,
    **MAMBA,
    **STRUCTURED_OUTPUTS,
    **PARALLEL,
    **CACHE,
    **OFFLOAD,
    **MULTIMODAL,
    **LORA,
    **LOGGING,
    **OBSERVABILITY,
    **SCHEDULER,
    **COMPILATION,
    **KERNEL,
    **ENGINE,
}
