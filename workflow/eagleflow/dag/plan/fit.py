"""What would make a run fit that does not (`suggest`, the plan's "Settings that would"), and
whether served mode's extraction servers and the trainer fit side by side on one host's GPUs
(`hidden_states.served.placement: host`; `side_by_side`, `served_fit`), for dag.plan.needs.

On GPUs of their own they fit when the host has enough of them (servers x server.gpus, and
one per training process). Sharing GPUs, a training process gets what vLLM leaves of one: vLLM
takes `--gpu-memory-utilization` of each GPU it runs on (0.9 unless `server.extra_args` says),
and at least its share of the weights."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from eagleflow.hidden_states.storage import FP8, num_stored_states, shard_bytes, target_topk, token_bytes

if TYPE_CHECKING:
    from eagleflow.dag.plan.needs import Plan

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


def suggest(
    plan: Plan, config: dict[str, Any], num_aux: int, hidden_size: int, weights: int, train_bytes: int
) -> list[str]:
    """Settings that would make a run fit that does not. Pure."""
    hs, tokens = config["hidden_states"], plan.tokens
    topk = target_topk(hs["target"], hs["topk"])
    num_states = num_stored_states(num_aux, topk)
    per_token = token_bytes(num_states, hidden_size, hs["dtype"], topk)
    out = []
    shards = plan.disk[0]
    if shards["bytes"] > shards["free"]:
        fit_tokens = shards["free"] // per_token
        if hs["dtype"] != FP8:
            fp8 = shard_bytes(tokens.tokens, tokens.samples, num_states, hidden_size, FP8, topk)
            out.append(
                f"hidden_states.dtype: {FP8} stores {fp8 / GB:.1f} GB instead; the draft's acceptance "
                "in vLLM against bf16 shards is in BENCHMARKS.md"
            )
        if not topk:
            compact = shard_bytes(tokens.tokens, tokens.samples, num_aux, hidden_size, hs["dtype"], hs["topk"])
            out.append(
                f"hidden_states.target: topk keeps the verifier's top-{hs['topk']} logits instead of the final "
                f"state: {compact / GB:.1f} GB (with {FP8} as well: "
                f"{shard_bytes(tokens.tokens, tokens.samples, num_aux, hidden_size, FP8, hs['topk']) / GB:.1f} GB)"
            )
        gpu = plan.gpu_memory
        if gpu is None or train_bytes + weights // max(1, config["train"]["nproc_per_node"]) < gpu:
            out.append(
                "hidden_states.mode: online computes the states during training and writes none, "
                "when the verifier fits on the training GPUs beside the draft (docs/operations.md)"
            )
        if tokens.samples:
            mean = tokens.tokens / tokens.samples
            out.append(
                f"prompts.max_train: about {int(fit_tokens / mean)} samples of {mean:.0f} tokens fit in "
                f"{shards['free'] / GB:.1f} GB free"
            )
        out.append(f"dataset.max_seq_len: a shorter cut lowers the longest samples ({tokens.longest} tokens now)")
    for row in plan.disk[1:]:
        if row["bytes"] > row["free"]:
            out.append(f"{row['where']}: {row['what']} need {row['bytes'] / GB:.1f} GB, {row['free'] / GB:.1f} free")
    online_bytes = train_bytes + weights
    if hs["mode"] == "online" and plan.gpu_memory is not None and online_bytes > plan.gpu_memory:
        out.append(
            f"hidden_states.mode: offline: online training holds the verifier ({weights / GB:.0f} GB) beside the "
            f"draft on every training GPU, about {online_bytes / GB:.0f} GB against {plan.gpu_memory / GB:.0f}"
        )
    elif plan.gpu_memory is not None and train_bytes > plan.gpu_memory:
        out.append(
            f"train.batch_tokens: training needs about {train_bytes / GB:.0f} GB per process, the GPU has "
            f"{plan.gpu_memory / GB:.0f}; halve batch_tokens (activations scale with it)"
        )
    return out


def served_fit(plan: Plan, config: dict[str, Any], weights: int, train_bytes: int, host_gpus: int | None) -> None:
    """Whether served mode's servers and the trainer fit side by side on one host (dag.plan.fit):
    a GPU row, and a setting that would fit when a served run does not (another mode's run is
    told whether served mode would fit its host)."""
    hs = config["hidden_states"]
    if hs["mode"] == "served" and hs["served"]["placement"] != "host":
        return
    fit = side_by_side(config, weights, train_bytes, plan.gpu_memory, host_gpus)
    if fit is None:
        return
    verdict = "fit" if fit.fits else "do not fit"
    plan.gpu.append(
        {"what": f"served mode on one host: the servers and the trainer side by side {verdict}", "bytes": fit.bytes}
        | {"per": fit.detail}
    )
    if fit.fits:
        return
    if hs["mode"] == "served":
        plan.suggestions.append(
            "hidden_states.served.placement: nodes (each server on a node of its own beside the trainer's, a "
            "SLURM run) or hidden_states.mode: offline (the states stored first): on one host the servers and "
            f"the trainer do not fit side by side ({fit.detail})"
        )
    else:
        plan.notes.append(
            f"hidden_states.mode: served would not fit this host: {fit.detail}. It stays {hs['mode']} here; served "
            "runs with placement: nodes (the servers on other nodes)"
        )
