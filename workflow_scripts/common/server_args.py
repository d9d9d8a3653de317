"""Which of the flags a vLLM server is launched with can change what it computes. Pure.

The launcher (runtime.spec) is run-only code and in no rule's fingerprint; the argv it builds
reaches the result keys as data instead: the response store's key (generate) and the shard
cache's key (hidden_states, vllm backend) hold `result_args` of the argv a job launches, and
the rules' params hold the same list, computed from the same launcher while Snakemake builds
the DAG. A launcher change that adds or changes a flag of this kind restales what it changes;
one that only changes how the server runs restales nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

# Flags that change how a server runs (where it listens, what it is called, how it is split
# across GPUs, whether it captures CUDA graphs), never a reply or a hidden state. `--model` is
# the verifier's path: its content is keyed apart (common.identity.verifier_fingerprint),
# and a path must not restale (docs/invalidation.md).
# Every other flag, including any in server.extra_args, counts as one that changes results.
RUN_ONLY_FLAGS = frozenset(
    {
        "--model",
        "--host",
        "--port",
        "--served-model-name",
        "--tensor-parallel-size",
        "--enforce-eager",
        "--disable-uvicorn-access-log",
    }
)


def server_args(argv: Sequence[str]) -> list[list[str]]:
    """[flag, value...] for each flag of a server's `argv`, in the order given, without the
    launcher before the first flag. A flag's values are the arguments up to the next flag
    (`--x=v` is one flag with value v)."""
    args = list(argv)
    start = next((i for i, a in enumerate(args) if a.startswith("--")), len(args))
    groups: list[list[str]] = []
    for arg in args[start:]:
        if arg.startswith("--"):
            groups.append(arg.split("=", 1))
        else:
            groups[-1].append(arg)
    return groups


def result_args(argv: Sequence[str]) -> list[list[str]]:
    """server_args of `argv` that can change a reply or a state: all but RUN_ONLY_FLAGS."""
    return [g for g in server_args(argv) if g[0] not in RUN_ONLY_FLAGS]
