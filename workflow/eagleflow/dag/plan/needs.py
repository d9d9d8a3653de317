"""The plan before a run: what a config will need, stage by stage, before any GPU hour is spent.

    python -m eagleflow.plan --configfile config/kimi-k2.5-8xgpu.yaml

prints the tokens the hidden-state stage will see, the bytes each stage writes and the free
space where they land, the GPU memory of the verifier and of the draft training, which
settings would make a run fit that does not, and the hours each stage and the whole run to a
served draft take for 1..N verifier replicas (`throughput`, dag.plan.hours; `--samples 10000
100000` gives them at other sizes). `snakemake -n` prints its one-line summary
(planned_disk_line).

Tokens are exact once the dataset exists (results/<run>/dataset/*.parquet); before that they
are an upper bound from the prompts: every reply at `generate.max_tokens`, prompt text at 3
characters per token (common.token_estimate), every sample cut at `dataset.max_seq_len`. GPU memory of the draft
training is an estimate from the draft's shape (weights, gradients, the optimizer's state, and the
activations and logits of one `train.batch_tokens` batch); the verifier's weights are the
size of its safetensors files, or an estimate from its config.json when they are not on this
machine (bf16, routed experts at the quantization config's bits).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from eagleflow.common.config import typed, validate_config
from eagleflow.dag.plan.bucket import bucket_section
from eagleflow.dag.plan.fit import served_fit, suggest
from eagleflow.dag.plan.hours import Rates, measured_rates, planned_work, render_hours
from eagleflow.dag.plan.sizes import (
    Geometry,
    draft_export_bytes,
    draft_params,
    draft_train_bytes,
    estimated_weight_bytes,
    free_bytes,
    gpu_count,
    gpu_memory_bytes,
    optimizer_state_floats,
    weight_bytes_on_disk,
)
from eagleflow.dag.plan.tokens import Tokens, planned_tokens
from eagleflow.dag.rule_params import check_renamed_keys
from eagleflow.dag.variants import merged
from eagleflow.hidden_states.layers import default_aux_layer_ids
from eagleflow.hidden_states.storage import num_stored_states, shard_bytes, target_topk, token_bytes
from eagleflow.runtime.output_cache import cache_bytes

DEFAULT_CONFIG = "config/config.yaml"
GB = 1e9


@dataclass
class Plan:
    run: str
    tokens: Tokens | None
    disk: list[dict[str, Any]] = field(default_factory=list)  # stage, what, bytes, where, free
    gpu: list[dict[str, Any]] = field(default_factory=list)  # what, bytes, per, detail
    gpu_memory: int | None = None  # bytes per GPU on this host, when known
    suggestions: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    hours: str = ""  # hours.render_hours' table
    bucket: str = ""  # bucket.render_bucket's table: a run whose states lie in a bucket


def verifier_dir(config: dict[str, Any], root: Path) -> Path:
    prepared = root / f"resources/verifier/{config['verifier']['name']}"
    if (prepared / "config.json").exists() or config["verifier"]["source"] != "path":
        return prepared
    return Path(config["verifier"]["path"])


def make_plan(
    config: dict[str, Any],
    root: Path = Path("."),
    verifier_config: dict[str, Any] | None = None,
    gpu_memory: int | None = None,
    assume_prompt_tokens: int = 256,
    samples: list[int] | None = None,
    host_gpus: int | None = None,
    link_gbps: float | None = None,
) -> Plan:
    """The plan for `config` run from `root`. `verifier_config`: config.json to use when the
    verifier is not on this machine; `gpu_memory`: bytes per GPU (default: nvidia-smi's);
    `samples`: sample counts to give the hours at (default: the run's own); `host_gpus`: GPUs
    of one host (default: nvidia-smi's count; without GPUs here, the servers' own); `link_gbps`:
    the link to the bucket, for a run whose states lie in one (`storage.states`, or asked for)."""
    run = config["run"]
    plan = Plan(run, None, gpu_memory=gpu_memory if gpu_memory is not None else gpu_memory_bytes())
    vdir = verifier_dir(config, root)
    if verifier_config is None:
        if not (vdir / "config.json").exists():
            plan.notes.append(
                f"{vdir}/config.json is not there yet: run `snakemake prepare_verifier` (or pass "
                "--verifier-config) for bytes and GPU memory"
            )
            return plan
        verifier_config = json.loads((vdir / "config.json").read_text())
    g = Geometry.from_config(verifier_config)
    plan.tokens = tokens = planned_tokens(config, root, assume_prompt_tokens)
    hs, server = config["hidden_states"], config["server"]
    num_aux = len(hs["aux_layer_ids"] or default_aux_layer_ids(g.num_layers))
    online = hs["mode"] == "online"
    served = hs["mode"] == "served"

    # Disk.
    topk = target_topk(hs["target"], hs["topk"])
    num_states = num_stored_states(num_aux, topk)
    per_token = token_bytes(num_states, g.hidden_size, hs["dtype"], topk)
    states_dir = root / f"results/{run}/hidden_states"
    # What the phase writes: the samples its store lacks (plan.tokens: stored_samples).
    shard_total = (
        0
        if online or served
        else shard_bytes(tokens.new_tokens, tokens.new_samples, num_states, g.hidden_size, hs["dtype"], topk)
    )
    stored = f"; {tokens.stored_samples} of {tokens.samples} samples stored already" if tokens.stored_samples else ""
    plan.disk.append(
        {
            "stage": "hidden_states",
            "online": online,
            "served": served,
            "what": f"no stored states (hidden_states.mode: {hs['mode']})"
            if online or served
            else f"{tokens.new_samples} samples in {hs['num_parts']} extraction job{'s' * (hs['num_parts'] > 1)}: "
            f"{num_states} states x "
            f"{g.hidden_size} in {hs['dtype']}"
            + (f" + top-{topk} logits" if topk else "")
            + f", {per_token} B/token{stored}",
            "bytes": shard_total,
            "where": states_dir,
        }
    )
    if served:
        plan.disk.append(served_in_flight(config, tokens, num_aux, g.hidden_size))
    if hs["backend"] == "vllm" and not online and not served:
        # vLLM's connector writes one file per request in flight (the server's dtype, bf16).
        in_flight = hs["vllm"]["concurrency"] if isinstance(hs["vllm"]["concurrency"], int) else 256
        where = Path(hs["vllm"]["storage_dir"] or "/tmp")
        plan.disk.append(
            {
                "stage": "hidden_states",
                "what": f"vLLM's per-request files, up to {in_flight} in flight at the longest sample",
                "bytes": in_flight * tokens.longest * (num_aux + 1) * g.hidden_size * 2,
                "where": where,
            }
        )
    drafts = distinct_drafts(config)
    checkpoint_bytes = {}
    for label, (draft_train, draft_vocab) in drafts.items():
        trainable, _ = draft_params(g, draft_train, draft_vocab, num_aux)
        # the weights, the best weights so far, the optimizer's state
        floats = 2 * trainable + optimizer_state_floats(g, draft_train, draft_vocab, num_aux)
        checkpoint_bytes[label] = floats * 4
        kept, optimizer = draft_train["keep_checkpoints"], draft_train["optimizer"]
        plan.disk.append(
            {
                "stage": "train",
                "what": f"{label}checkpoints: {kept} kept, weights and {optimizer} state in fp32",
                "bytes": kept * checkpoint_bytes[label] if draft_train["checkpoint_every"] else 0,
                "where": root / f"results/{run}/drafts",
            }
        )
        plan.disk.append(
            {
                "stage": "train",
                "what": f"{label}the exported draft (bf16, what vLLM loads)",
                "bytes": draft_export_bytes(g, draft_train, draft_vocab, num_aux),
                "where": root / f"results/{run}/drafts",
            }
        )
    # Already on disk, not written: the output cache's entries whose outputs were replaced or
    # removed (the rest are links of the outputs and take nothing). Prune frees them.
    entries, held = cache_bytes(root / f"results/{run}")
    if entries:
        plan.disk.append(
            {
                "stage": "output cache",
                "what": f"{entries} entries; the bytes only the cache holds "
                "(`python -m eagleflow.runtime.output_cache prune` frees them)",
                "bytes": held,
                "where": root / f"results/{run}",
            }
        )
    for row in plan.disk:
        row["free"] = free_bytes(row["where"])

    # GPU memory.
    weights = weight_bytes_on_disk(vdir) if vdir.exists() else None
    estimated = weights is None
    weights = estimated_weight_bytes(verifier_config) if weights is None else weights
    tp = max(1, server["tensor_parallel_size"])
    plan.gpu.append(
        {
            "what": "verifier weights (vLLM: generate, extraction, benchmark)",
            "bytes": weights // tp,
            "per": f"per GPU at tensor_parallel_size {tp} ({weights / GB:.1f} GB in all"
            + (", estimated from config.json)" if estimated else ")"),
        }
    )
    for label, (draft_train, draft_vocab) in drafts.items():
        mem_of = draft_train_bytes(g, draft_train, draft_vocab, num_aux)
        plan.gpu.append(
            {
                "what": f"{label}draft training (estimate)",
                "bytes": mem_of["total"],
                "per": f"per process ({draft_train['nproc_per_node']}): {mem_of['trainable'] / 1e6:.0f}M trainable + "
                f"{mem_of['frozen'] / 1e6:.0f}M frozen params {mem_of['state'] / GB:.1f} GB, activations at "
                f"batch_tokens {draft_train['batch_tokens']} {mem_of['activations'] / GB:.1f} GB",
            }
        )
    # The most any draft of the run needs: what the suggestions below size against.
    mem = max((draft_train_bytes(g, *d, num_aux) for d in drafts.values()), key=lambda m: m["total"])
    if online:
        plan.gpu.append(
            {
                "what": "online mode: the verifier beside the draft",
                "bytes": mem["total"] + weights,
                "per": "per training GPU: every training process loads the whole verifier on its GPU",
            }
        )
    plan.suggestions = suggest(plan, config, num_aux, g.hidden_size, weights, mem["total"])
    served_fit(plan, config, weights, mem["total"], host_gpus if host_gpus is not None else gpu_count())
    rates, measured = measured_rates(root, run, typed(Rates, config["throughput"], "throughput"))
    work = planned_work(
        tokens.samples,
        tokens.tokens,
        tokens.source.startswith("exact"),
        config,
        rates,
        tokens.stored_tokens,
        [d.train for d in drafts.values()],
    )
    plan.hours = render_hours(work, rates, config, samples)
    plan.notes += measured
    if link_gbps or config["storage"]["states"]:
        every = (
            0
            if online or served
            else shard_bytes(tokens.tokens, tokens.samples, num_states, g.hidden_size, hs["dtype"], topk)
        )
        exports = {label: draft_export_bytes(g, d.train, d.vocab, num_aux) for label, d in drafts.items()}
        plan.bucket = bucket_section(
            config, shard_total, every, drafts, exports, work, rates, link_gbps or 10.0, checkpoint_bytes
        )
    return plan


class PlannedDraft(NamedTuple):
    """A draft the run trains: its `train` section and the size of its draft vocabulary."""

    train: dict[str, Any]
    vocab: int


def distinct_drafts(config: dict[str, Any]) -> dict[str, PlannedDraft]:
    """{label: PlannedDraft} of every distinct draft the run trains (variants that agree on
    their vocab and train sections share one); the label is empty for a run of one draft, else
    `<draft id> (<method>): `. Pure."""
    from eagleflow.dag.variants import draft_id, variant_config, variant_overrides

    drafts: dict[str, PlannedDraft] = {}
    for name in variant_overrides(config):
        v = variant_config(config, name)
        drafts.setdefault(draft_id(config, name), PlannedDraft(v["train"], v["vocab"]["draft_vocab_size"]))
    if len(drafts) == 1:
        return {"": next(iter(drafts.values()))}
    return {f"{d} ({p.train['method']}): ": p for d, p in drafts.items()}


def render(plan: Plan) -> str:
    """The plan as Markdown. Pure."""
    lines = [f"# Plan: run {plan.run}", ""]
    if plan.tokens is not None:
        t = plan.tokens
        lines += [f"Samples {t.samples}, tokens {t.tokens:,}, longest {t.longest} ({t.source}).", ""]
    if plan.disk:
        lines += ["| stage | writes | bytes | where | free there |", "|---|---|---|---|---|"]
        for r in plan.disk:
            lines.append(f"| {r['stage']} | {r['what']} | {gb(r['bytes'])} | {r['where']} | {gb(r['free'])} |")
        lines.append("")
    if plan.gpu:
        has = f"{plan.gpu_memory / GB:.0f} GB per GPU here" if plan.gpu_memory else "no GPU here"
        lines += [f"GPU memory ({has}):", "", "| what | bytes | detail |", "|---|---|---|"]
        lines += [f"| {r['what']} | {gb(r['bytes'])} | {r['per']} |" for r in plan.gpu]
        lines.append("")
    if plan.suggestions:
        lines += ["Does not fit. Settings that would:", *[f"- {s}" for s in plan.suggestions], ""]
    elif plan.disk:
        lines += ["Fits: every stage's bytes are below the free space where they land.", ""]
    if plan.hours:
        lines += ["Hours per stage (`throughput`; replicas: verifier servers answering at once):", "", plan.hours]
    if plan.bucket:
        lines += [plan.bucket]
    lines += [f"Note: {n}" for n in plan.notes]
    return "\n".join(lines).rstrip() + "\n"


def served_in_flight(config: dict[str, Any], tokens: Any, num_aux: int, hidden_size: int) -> dict[str, Any]:
    """Served mode's row: nothing stored; the verifier requests each epoch makes and the most
    bytes of states in flight, the bound plus one training batch (train/feed.py), as the
    trainer holds them (float32). Pure."""
    bound = int(config["hidden_states"]["served"]["max_inflight_mb"] * 2**20)
    batch = config["train"]["batch_tokens"] * (num_aux + 1) * hidden_size * 4
    epochs = config["train"]["epochs"] * config["train"]["sample_fraction"]
    return {
        "stage": "train",
        "served": True,
        "what": f"states in flight to the train job ({config['hidden_states']['served']['transfer']} transfer): "
        f"{tokens.samples:,} verifier requests ({tokens.tokens:,} tokens) an epoch, {epochs:g} epochs, "
        "every epoch extracted again",
        "bytes": bound + batch,
        "requests_per_epoch": tokens.samples,
        "where": Path(config["hidden_states"]["served"]["storage_dir"] or "/tmp")
        if config["hidden_states"]["served"]["transfer"] == "file"
        else Path("/dev/shm"),
    }


def summary_line(plan: Plan) -> str:
    """The line `snakemake -n` prints. Pure."""
    if not plan.disk:
        return "Hidden states: " + (plan.notes[0] if plan.notes else "unknown")
    shards, t = plan.disk[0], plan.tokens
    if shards.get("online"):
        return "Hidden states: none on disk (hidden_states.mode: online: the train job computes them)"
    if shards.get("served"):
        flight = plan.disk[1]
        return (
            f"Hidden states: none on disk (hidden_states.mode: served): {flight['requests_per_epoch']:,} verifier "
            f"requests an epoch stream them to the train job, at most {gb(flight['bytes'])} in flight"
        )
    fits = "fits" if not plan.suggestions else "DOES NOT FIT (python -m eagleflow.plan names settings that do)"
    stored = f" ({t.stored_samples:,} of {t.samples:,} samples stored already)" if t.stored_samples else ""
    return (
        f"Hidden states this run writes: {gb(shards['bytes'])} for {t.new_tokens:,} tokens of "
        f"{t.new_samples:,} samples{stored} ({t.source.split(':')[0]}) in {shards['where']}, "
        f"{gb(shards['free'])} free: {fits}"
    )


def gb(n: int) -> str:
    return f"{n / GB:.2f} GB" if n >= 0.01 * GB else f"{n / 1e6:.2f} MB"


def load_merged_config(configfiles: list[str], root: Path) -> dict[str, Any]:
    """config/config.yaml with each file merged over it, as `snakemake --configfile` does."""
    config = yaml.safe_load((root / DEFAULT_CONFIG).read_text())
    for path in configfiles:
        config = merged(config, yaml.safe_load(Path(path).read_text()) or {})
    check_renamed_keys(config)
    validate_config(config)
    return config


def planned_disk_line(jobs: dict[str, int], config: dict[str, Any], root: Path) -> str | None:
    """The line `snakemake -n` prints when the jobs it plans (rule -> count) include the
    hidden-state stage or training; None otherwise."""
    if not (jobs.get("hidden_states") or jobs.get("train")):
        return None
    try:
        return summary_line(make_plan(config, root))
    except (OSError, ValueError, KeyError) as exc:
        return f"Hidden states: no plan ({exc})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eagleflow.plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--configfile", action="append", default=[], help="merged over config/config.yaml, in order")
    ap.add_argument("--verifier-config", help="the verifier's config.json, when the verifier is not on this machine")
    ap.add_argument("--gpu-memory-gb", type=float, help="memory per GPU (default: nvidia-smi's)")
    ap.add_argument("--host-gpus", type=int, help="GPUs of one host (default: nvidia-smi's; without: the server's)")
    ap.add_argument("--assume-prompt-tokens", type=int, default=256, help="prompt length when the prompts are absent")
    ap.add_argument("--samples", type=int, nargs="+", help="give the hours at these sample counts")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    ap.add_argument(
        "--link-gbps",
        type=float,
        help="the hours through a bucket at this link speed (default 10 where storage.states is set)",
    )
    args = ap.parse_args(argv)
    root = Path(".")
    config = load_merged_config(args.configfile, root)
    plan = make_plan(
        config,
        root,
        verifier_config=json.loads(Path(args.verifier_config).read_text()) if args.verifier_config else None,
        gpu_memory=int(args.gpu_memory_gb * GB) if args.gpu_memory_gb else None,
        assume_prompt_tokens=args.assume_prompt_tokens,
        samples=args.samples,
        host_gpus=args.host_gpus,
        link_gbps=args.link_gbps,
    )
    if args.json:
        print(json.dumps(plan, default=lambda o: o.__dict__ if hasattr(o, "__dict__") else str(o), indent=1))
    else:
        print(render(plan), end="")
    return 1 if plan.suggestions else 0
