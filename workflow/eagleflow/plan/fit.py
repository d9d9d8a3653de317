"""Whether served mode's extraction servers and the trainer fit side by side on one host's
GPUs (`hidden_states.served.placement: host`), for the plan's GPU table (plan.needs).

On GPUs of their own they fit when the host has enough of them (servers x server.gpus, and
one per training process). Sharing GPUs, a training process gets what vLLM leaves of one: vLLM
takes `--gpu-memory-utilization` of each GPU it runs on (0.9 unless `server.extra_args` says),
and at least its share of the weights."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GB = 10**9
VLLM_DEFAULT_UTILIZATION = 0.9


@dataclass(frozen=True)
class SideBySide:
    fits: bool
    detail: str  # why, in a sentence for the plan's table
    bytes: int  # what one shared GPU must hold, or the training process's need on its own GPU


def memory_utilization(extra_args: list[str]) -> float:
    """vLLM's --gpu-memory-utilization among the server's flags (either spelling). Pure."""
    for i, arg in enumerate(extra_args):
        for flag in ("--gpu-memory-utilization", "--device-memory-utilization"):
            if arg == flag and i + 1 < len(extra_args):
                return float(extra_args[i + 1])
            if arg.startswith(flag + "="):
                return float(arg.split("=", 1)[1])
    return VLLM_DEFAULT_UTILIZATION


def side_by_side(
    config: dict[str, Any], weights: int, train_bytes: int, gpu_memory: int | None, host_gpus: int | None
) -> SideBySide | None:
    """The verdict for a run whose train job launches its servers on its host (None when it
    does not: other modes, endpoints, placement nodes). `host_gpus`: the host's GPU count
    (None: the servers' own, server.gpus x servers: a host the verifier fills). Pure."""
    hs, server, train = config["hidden_states"], config["server"], config["train"]
    served = hs["served"]
    if server["endpoint"] or served["endpoints"]:
        return None
    servers, per_server = served["servers"], max(1, server["gpus"])
    server_gpus = servers * per_server
    trainers = train["nproc_per_node"]
    host = host_gpus if host_gpus is not None else server_gpus
    if server_gpus + trainers <= host:
        return SideBySide(
            True,
            f"on GPUs of their own: the servers take {server_gpus} ({servers} x {per_server}), training "
            f"{trainers}, of the host's {host}",
            train_bytes,
        )
    if gpu_memory is None:
        return SideBySide(
            False,
            f"the servers take {server_gpus} of the host's {host} GPUs and training needs {trainers} more; "
            "sharing a GPU depends on its memory (--gpu-memory-gb)",
            train_bytes,
        )
    utilization = memory_utilization(list(server["extra_args"]))
    tp = max(1, server["tensor_parallel_size"])
    taken = max(int(utilization * gpu_memory), weights // tp)
    left = max(0, gpu_memory - taken)
    fits = train_bytes <= left
    return SideBySide(
        fits,
        f"sharing GPUs ({server_gpus} for the servers + {trainers} for training > the host's {host}): vLLM takes "
        f"{taken / GB:.1f} GB of each ({utilization:g} of {gpu_memory / GB:.0f} GB, weights {weights / tp / GB:.1f} GB "
        f"at TP {tp}), leaving {left / GB:.1f} GB against training's {train_bytes / GB:.1f} GB a process",
        taken + train_bytes,
    )
