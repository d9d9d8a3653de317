# Helpers shared by every rule: config validation, paths, code fingerprints, variants. What the
# rules' params hold is eagleflow/dag/rule_params.py's (tested there); the rules call it with `config`.
import re
import sys
from pathlib import Path

from snakemake.logging import logger

import eagleflow

from eagleflow.common.config import validate_config
from eagleflow.common.fingerprint import code_fingerprint
from eagleflow.dag.code_keys import code_key
from eagleflow.dag import rule_params
from eagleflow.dag.rule_params import check_renamed_keys, sorted_keys
from eagleflow.runtime.server_args import result_args
from eagleflow.runtime.cache_plan import plan_cache
from eagleflow.runtime.process import first_on_pythonpath
from eagleflow.runtime.spec import ServerConfig, ServerSpec
from eagleflow.dag.plan.loads import RunInfoLine, describe_planned
from eagleflow.dag.plan.needs import planned_disk_line
from eagleflow.dag.object_storage import setup_object_storage
from eagleflow.dag.variants import (
    check_drafts_servable,
    draft_id,
    draft_variant,
    validate_variants,
    variant_config,
    variant_overrides,
    vocab_id,
    vocab_section,
)

check_renamed_keys(config)
validate_config(config)
validate_variants(config)
# Under `--default-storage-provider s3` the hidden-state store follows the outputs into the
# bucket, the credentials are checked before any job, and the output cache is off
# (dag/object_storage.py).
STORAGE_LINE = setup_object_storage(
    config,
    workflow.storage_settings.default_storage_provider,
    workflow.storage_settings.default_storage_prefix,
)
if STORAGE_LINE:
    print(STORAGE_LINE, file=sys.stderr)
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
    and every eagleflow module it imports, transitively (or the fingerprint an edit of it is
    declared byte-equivalent to: dag/code_keys.py).

    Passed as a param: Snakemake only tracks the `script:` file itself, so without this an
    edit to the stage module would not restale the rule. Comments and docstrings do not count.
    """
    fingerprint = code_key(
        script, code_fingerprint(f"eagleflow.entry.{script}", SCRIPTS_DIR)
    )
    # Worded so that `snakemake -n` says what changed: "Params have changed ... before:
    # 'code <old> of entry/x.py and its imports' now: 'code <new> ...'".
    return f"code {fingerprint} of entry/{script}.py and its imports"


def variant_results(path):
    """Path of a variant's output: results/<run>/variants/{variant}/<path>."""
    return results(f"variants/{{variant}}/{path}")


def every_variant(path):
    """`path` under every variant of the run (variants/<name>/<path>)."""
    return expand(results(f"variants/{{variant}}/{path}"), variant=VARIANTS)


def variant_section(name):
    """Config section `name` as the job's variant sees it, as a param (keys sorted)."""

    def param(wildcards):
        return sorted_keys(variant_config(config, wildcards.variant)[name])

    return param


def draft_results(path):
    """Path of a draft's output: results/<run>/drafts/{draft}/<path> (shared by the variants
    whose vocab and train sections agree)."""
    return results(f"drafts/{{draft}}/{path}")


def draft_section(name):
    """Config section `name` (vocab or train) of the job's draft, as a param."""

    def param(wildcards):
        return sorted_keys(
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
    return sorted_keys(vocab_section(config, wildcards.vocab))


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


def all_cores():
    """Threads for the stages that use the whole machine (vLLM, training): the --cores
    count, which Snakemake also caps per job. Commands that run no job (--report, --lint)
    give no core count; 1 then, rather than failing them."""
    try:
        return workflow.cores
    except WorkflowError:
        return 1


def part_paths():
    """The extraction parts' manifests (hidden_states.run: one job per part, its samples by a
    stable hash of their ids)."""
    n = config["hidden_states"]["num_parts"]
    return [results(f"hidden_states/part-{i:05d}.json") for i in range(n)]


# The conda environment of the jobs that extract the verifier's states (hidden_states, parity), by
# backend: vLLM's extraction server starts with the job's own interpreter.
EXTRACTION_ENVS = {"hf": "../envs/train.yaml", "vllm": "../envs/extract.yaml"}


def serve_verifier_path(wildcards, input):
    """The verifier path the exported draft names: `verifier.serve_path`, else the prepared
    verifier (the job's input, relative to the workdir; the job makes it absolute), so that
    the same results in another directory restale nothing."""
    return config["verifier"]["serve_path"] or input.verifier


def server_result_args():
    """The verifier server's flags that can change a reply or a state (runtime/server_args.py):
    what generate's store keys and the vllm backend's state keys hold."""
    return result_args(VERIFIER_ARGV)


def prompt_sources(wildcards):
    """The prompts rule's inputs: the prompt file and the verifier's written conversations,
    whichever the config asks for."""
    prompts = config["prompts"]
    # The prompt file is the user's, beside the config: never a storage object (local()).
    sources = {"source": local(prompts["source"])} if prompts["source"] else {}
    if prompts["written"]["count"]:
        sources["written"] = results("prompts/written.jsonl")
    return sources


def response_store():
    """The response store generate and write_prompts read and fill: generate.store, else
    one per run."""
    return config["generate"]["store"] or results("generate/store.sqlite")


def train_states(wildcards):
    """What the train job reads the verifier's states from: the index of the stored samples, or
    (hidden_states.mode: online, served) the dataset, whose states it computes itself or a
    vLLM server extracts as it trains."""
    if config["hidden_states"]["mode"] in ("online", "served"):
        return {
            "dataset": [
                results("dataset/train.parquet"),
                results("dataset/eval.parquet"),
            ]
        }
    return {"index": results("hidden_states/index.json")}


def parity_report(wildcards):
    """The variant's parity report, unless parity.enabled is false."""
    if not config["parity"]["enabled"]:
        return []
    return results(f"variants/{wildcards.variant}/parity/report.json")


def per_variant(param):
    """A rule_params function of (config, variant) as the param of a job's {variant}."""
    return lambda wildcards: param(config, wildcards.variant)
