# Helpers shared by every rule: config validation, paths, code fingerprints, variants.
import re
import sys
from pathlib import Path

from snakemake.logging import logger

import eagleflow

from eagleflow.common.config import validate_config
from eagleflow.common.fingerprint import code_fingerprint
from eagleflow.common.server_args import result_args, server_args
from eagleflow.runtime.cache_plan import plan_cache
from eagleflow.runtime.process import first_on_pythonpath
from eagleflow.runtime.spec import ServerConfig, ServerSpec
from eagleflow.plan.loads import RunInfoLine, describe_planned
from eagleflow.plan.needs import planned_disk_line
from eagleflow.variants import (
    check_drafts_servable,
    draft_id,
    draft_variant,
    validate_variants,
    variant_config,
    variant_overrides,
    vocab_id,
    vocab_section,
)

validate_config(config)
validate_variants(config)
# `snakemake -n` (and every run) says how many times the jobs it plans load the verifier,
# what the hidden states will take on disk (`python -m eagleflow.plan`: all of it),
# and which planned jobs the output cache may restore; a run marks the jobs that must
# recompute (forced, or an output deleted) before any job starts.
for line in (
    lambda jobs: describe_planned(jobs, config),
    lambda jobs: planned_disk_line(jobs, config, Path(".")),
    lambda jobs: plan_cache(workflow.dag, mark=not workflow.dryrun),
):
    logger.addHandler(
        RunInfoLine(line, lambda text: print(text, file=sys.stderr, flush=True))
    )

RUN = config["run"]
VARIANTS = list(variant_overrides(config))
# The package the jobs run, as imported here: the checkout's (Snakemake puts the directory of
# this workflow's Snakefile on sys.path, as a module too, where workflow.basedir is the
# importing workflow's) or the installed one. Its code is fingerprinted from there, and every
# job imports it from there too: first on the PYTHONPATH the jobs inherit (a job's own
# sys.path would put an installed eagleflow, an editable install's included, before it).
SCRIPTS_DIR = Path(eagleflow.__file__).resolve().parent
first_on_pythonpath(str(SCRIPTS_DIR.parent))
VERIFIER_DIR = f"resources/verifier/{config['verifier']['name']}"
# Before any job: a draft vLLM could not serve would otherwise fail at the benchmark.
check_drafts_servable(config, VERIFIER_DIR)
# The argv the launcher starts the verifier's vLLM with (port 0: no port counts); the rules'
# server params are read from it.
VERIFIER_ARGV = ServerSpec.from_config(
    ServerConfig.from_section(config["server"]), VERIFIER_DIR
).command(0)


wildcard_constraints:
    states_part=r"\d{5}",
    part=r"\d+-of-\d+",
    variant="|".join(re.escape(v) for v in VARIANTS),
    vocab=r"default|v-[0-9a-f]{8}",
    draft=r"default|d-[0-9a-f]{8}",


def results(path):
    """Path of a run output: results/<run>/<path>."""
    return f"results/{RUN}/{path}"


def logs(name):
    return f"results/{RUN}/logs/{name}.log"


def benchmarks(name):
    return f"results/{RUN}/benchmarks/{name}.tsv"


def code(script):
    """Fingerprint of the code that runs in a job: its `script:` (workflow/eagleflow/entry/<script>.py)
    and every eagleflow module it imports, transitively.

    Passed as a param: Snakemake only tracks the `script:` file itself, so without this an
    edit to the stage module would not restale the rule. Comments and docstrings do not count.
    """
    fingerprint = code_fingerprint(f"eagleflow.entry.{script}", SCRIPTS_DIR)
    # Worded so that `snakemake -n` says what changed: "Params have changed ... before:
    # 'code <old> of entry/x.py and its imports' now: 'code <new> ...'".
    return f"code {fingerprint} of entry/{script}.py and its imports"


def section(name):
    """A config section as a param, keys sorted at every level.

    Snakemake compares params as text: sorting makes the comparison blind to key order, so
    reordering a config file restales nothing while any changed value still does.
    """
    return _sorted(config[name])


def _sorted(value):
    if isinstance(value, dict):
        return {k: _sorted(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_sorted(v) for v in value]
    return value


def variant_results(path):
    """Path of a variant's output: results/<run>/variants/{variant}/<path>."""
    return results(f"variants/{{variant}}/{path}")


def every_variant(path):
    """`path` under every variant of the run (variants/<name>/<path>)."""
    return expand(results(f"variants/{{variant}}/{path}"), variant=VARIANTS)


def variant_section(name):
    """Config section `name` as the job's variant sees it, as a param (keys sorted)."""

    def param(wildcards):
        return _sorted(variant_config(config, wildcards.variant)[name])

    return param


def draft_results(path):
    """Path of a draft's output: results/<run>/drafts/{draft}/<path> (shared by the variants
    whose vocab and train sections agree)."""
    return results(f"drafts/{{draft}}/{path}")


def draft_section(name):
    """Config section `name` (vocab or train) of the job's draft, as a param."""

    def param(wildcards):
        return _sorted(
            variant_config(config, draft_variant(config, wildcards.draft))[name]
        )

    return param


def draft_vocab(file):
    """A file of the vocabulary the job's draft is trained with."""

    def path(wildcards):
        return results(
            f"vocab/{vocab_id(config, draft_variant(config, wildcards.draft))}/{file}"
        )

    return path


def variant_draft(path):
    """A file of the job's variant's draft."""

    def resolve(wildcards):
        return results(f"drafts/{draft_id(config, wildcards.variant)}/{path}")

    return resolve


def variant_vocab(file):
    """A file of the job's variant's vocabulary."""

    def path(wildcards):
        return results(f"vocab/{vocab_id(config, wildcards.variant)}/{file}")

    return path


def every_draft(path):
    """`path` of every variant's draft, in the order of VARIANTS (repeats where shared)."""
    return [results(f"drafts/{draft_id(config, v)}/{path}") for v in VARIANTS]


def every_train_benchmark():
    """The train job's benchmark file of every variant's draft, in the order of VARIANTS."""
    return [benchmarks(f"train.{draft_id(config, v)}") for v in VARIANTS]


def vocab_param(wildcards):
    """The vocab section behind the job's vocab id, as a param."""
    return _sorted(vocab_section(config, wildcards.vocab))


def checkpoint_dir(wildcards):
    """Not an output: a failed or killed train job's checkpoints must survive for the rerun."""
    return results(f"drafts/{wildcards.draft}/train/checkpoints")


def baseline_report(wildcards):
    """The shared baseline measurement, unless every benchmark measures its own (paired)."""
    return (
        []
        if config["benchmark"]["paired_baseline"]
        else results("baseline/report.json")
    )


def baseline_workload():
    """What the verifier alone is measured on: the benchmark settings that shape the workload
    (the number of speculative tokens does not), so every draft's benchmark reuses it.
    """
    return {
        key: config["benchmark"][key]
        for key in ("max_tokens", "concurrency", "temperatures", "seed")
    } | {"chat_template_kwargs": chat_template_kwargs()}


def benchmark_sets_param():
    """`benchmark.sets` as a param, each entry's keys sorted."""
    return [_sorted(entry) for entry in config["benchmark"]["sets"]]


def chat_template_kwargs():
    """generate.chat_template_kwargs as a param: the benchmark and write_prompts format their
    prompts as generate formats the training prompts."""
    return _sorted(config["generate"]["chat_template_kwargs"])


def learning_curve_variants():
    """The variants trained on a subset of the training conversations."""
    return [
        v for v in VARIANTS if variant_config(config, v)["train"]["sample_fraction"] < 1
    ]


def k_variants():
    """The variants that differ from the config only in benchmark.num_speculative_tokens: the
    measured checks of the report's k prediction."""
    return [
        v
        for v, o in variant_overrides(config).items()
        if v != VARIANTS[0] and set(o) == {"benchmark"}
    ]


def all_cores():
    """Threads for the stages that use the whole machine (vLLM, training): the --cores
    count, which Snakemake also caps per job. Commands that run no job (--report, --lint)
    give no core count; 1 then, rather than failing them."""
    try:
        return workflow.cores
    except WorkflowError:
        return 1


def gpus(stage):
    """GPUs one job of `stage` takes, as the `gpu` resource: the profile caps the total
    (local-gpu: --resources gpu=N) or requests them (slurm). A stage that uses an already
    running server takes none; a vllm-backend extraction job takes its server's."""
    server_gpus = config["server"]["gpus"]
    if stage == "generate":
        return 0 if config["server"]["endpoint"] else server_gpus
    if stage == "benchmark":
        return server_gpus
    if stage == "hidden_states" and config["hidden_states"]["backend"] == "vllm":
        return 0 if config["hidden_states"]["vllm"]["endpoint"] else server_gpus
    return config[stage]["gpus"]


def part_paths():
    """The extraction parts' manifests (hidden_states.run: one job per part, its samples by a
    stable hash of their ids)."""
    n = config["hidden_states"]["num_shards"]
    return [results(f"hidden_states/part-{i:05d}.json") for i in range(n)]


# The conda environment of the jobs that extract the verifier's states (hidden_states, parity), by
# backend: vLLM's extraction server starts with the job's own interpreter.
EXTRACTION_ENVS = {"hf": "../envs/train.yaml", "vllm": "../envs/extract.yaml"}


def hidden_states_server():
    """The verifier server's result flags, for the vllm backend only: a server setting must
    not restale shards that transformers extracted."""
    return server_result_args() if config["hidden_states"]["backend"] == "vllm" else []


def measured_server():
    """What a benchmark measures the verifier's server as: every flag it is launched with
    (speed counts here, so tensor parallelism and eager mode do) but its port and the
    verifier's path, and its environment."""
    argv = [
        a
        for flag in server_args(VERIFIER_ARGV)
        if flag[0] not in ("--port", "--model")
        for a in flag
    ]
    return {"argv": argv, "env": _sorted(config["server"]["env"])}


def serve_verifier_path(wildcards, input):
    """The verifier path the exported draft names: `verifier.serve_path`, else the prepared
    verifier (the job's input, relative to the workdir; the job makes it absolute), so that
    the same results in another directory restale nothing."""
    return config["verifier"]["serve_path"] or input.verifier


def verifier_source():
    """Where the verifier's weights come from (what prepare_verifier's output depends on)."""
    return {key: config["verifier"][key] for key in ("source", "path")}


def generate_requests():
    """What generate asks the verifier (the settings that change a request)."""
    generate = config["generate"]
    sampling = {
        k: generate[k]
        for k in ("max_tokens", "temperature", "top_p", "seed")
        if generate[k] is not None
    }
    return _sorted(
        {
            "model": config["server"]["served_model_name"],
            "sampling": sampling | generate["extra_body"],
            "chat_template_kwargs": generate["chat_template_kwargs"],
        }
    )


def server_result_args():
    """The flags the verifier's server is launched with that can change a reply or a state,
    from the argv the launcher builds (common/server_args.py): what generate's store keys and
    the vllm backend's shard keys hold. Run-only settings (timeouts, restarts, host, GPUs)
    are not among them, and the launcher's code is in no fingerprint."""
    return result_args(VERIFIER_ARGV)


def prompt_sources(wildcards):
    """The prompts rule's inputs: the prompt file and the verifier's written conversations,
    whichever the config asks for."""
    prompts = config["prompts"]
    sources = {"source": prompts["source"]} if prompts["source"] else {}
    if prompts["written"]["count"]:
        sources["written"] = results("prompts/written.jsonl")
    return sources


def written_section():
    """`prompts.written` as write_prompts' param: the filters, weights and split are not in
    it, so changing them sends no request."""
    return _sorted(config["prompts"]["written"])


def written_replies():
    """generate's requests, for the replies between written turns; none for one turn."""
    return generate_requests() if config["prompts"]["written"]["turns"] > 1 else None


def overlap_sets():
    """The benchmark sets whose items a training prompt must not resemble: MT-Bench and
    HumanEval always (bench/standard_sets.py measures any run's draft on them, whatever
    benchmark.sets holds), and benchmark.sets' prompt files; none with the filter off.
    """
    if config["prompts"]["filters"]["benchmark_overlap"] is None:
        return []
    files = [
        {"name": entry["name"], "path": entry["path"]}
        for entry in config["benchmark"]["sets"]
        if entry.get("path")
    ]
    return [{"name": "mt_bench"}, {"name": "humaneval"}, *files]


def generate_shards():
    """The generate jobs' names (runtime/store.py, generate/run.py: Shard): `<i>-of-<n>`."""
    n = config["generate"]["shards"]
    return [f"{i}-of-{n}" for i in range(n)]


def response_store():
    """The response store generate and write_prompts read and fill: generate.store, else
    one per run."""
    return config["generate"]["store"] or results("generate/store.sqlite")


def synth_parsing():
    """How synth reads replies; none of it reaches a request."""
    synth = config["synth"]
    return {
        "expect_reasoning": synth["expect_reasoning"],
        "think_markers": synth["think_markers"],
        "chat_template_kwargs": config["generate"]["chat_template_kwargs"],
        "verify_token_ids": synth["verify_token_ids"],
        "trust_remote_code": config["verifier"]["trust_remote_code"],
    }


def train_states(wildcards):
    """What the train job reads the verifier's states from: the index of the stored samples, or
    (hidden_states.mode: online) the dataset, whose states it computes itself."""
    if config["hidden_states"]["mode"] == "online":
        return {
            "dataset": [
                results("dataset/train.parquet"),
                results("dataset/eval.parquet"),
            ]
        }
    return {"index": results("hidden_states/index.json")}


def online_states():
    """Online mode: the hidden_states settings the train job computes states with. None
    offline, so that no hidden_states setting restales an offline train job."""
    hs = config["hidden_states"]
    if hs["mode"] != "online":
        return None
    keys = ("aux_layer_ids", "dtype", "compute_dtype", "batch_tokens")
    return {k: hs[k] for k in keys} | {
        "trust_remote_code": config["verifier"]["trust_remote_code"]
    }


def parity_report(wildcards):
    """The variant's parity report, unless parity.enabled is false."""
    if not config["parity"]["enabled"]:
        return []
    return results(f"variants/{wildcards.variant}/parity/report.json")
