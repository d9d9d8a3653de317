"""What the rules' params hold: which config keys (and which of the server's flags) each rule
depends on, so that a change to a key reruns the rules that read it and no other. Pure
functions of the validated config; the rules call them with `config` (workflow/rules/*.smk).

Snakemake compares params as text: `sorted_keys` makes every section blind to key order, so
reordering a config file restales nothing while any changed value still does. A param that
holds nothing the rule's outputs depend on is a spurious rerun; one that misses a key is a
stale result: tests/unit/test_rule_params.py holds each function to which keys move it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from eagleflow.common.config import ConfigError, typed
from eagleflow.dag.variants import variant_config, variant_overrides
from eagleflow.runtime.server_args import result_args, server_args


def sorted_keys(value: Any) -> Any:
    """`value` with the keys of every dict in it sorted, at every level."""
    if isinstance(value, dict):
        return {k: sorted_keys(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [sorted_keys(v) for v in value]
    return value


# Config keys that the stage code reads by an older name, and which the rules' params carry
# under it: {section: {config key: the stage's name}}. hidden_states.num_parts was num_shards,
# and that name is a field of the stage's settings (hidden_states.backend.HiddenStatesConfig),
# code in the fingerprint that keys every stored sample (hidden_states.run.content_settings):
# renamed there, every sample would be extracted again. Carried under it, the params are what
# they were, and the rename reruns no job.
STAGE_NAMES = {"hidden_states": {"num_parts": "num_shards"}}


def section_param(config: dict[str, Any], name: str, without: Sequence[str] = ()) -> dict[str, Any]:
    """Config section `name` as a rule's param: less the subsections `without` that its jobs
    never read, each key under the name the stage's code reads it by (STAGE_NAMES), keys
    sorted at every level."""
    names = STAGE_NAMES.get(name, {})
    return sorted_keys({names.get(k, k): v for k, v in config[name].items() if k not in without})


def check_renamed_keys(config: dict[str, Any]) -> None:
    """Refuse a config that sets a key by the name it had before (STAGE_NAMES), naming the
    new one: the schema alone would call it an unknown key. Run before validate_config."""
    found = [
        f"{section}.{old}: renamed {section}.{new}; set {new} instead (the same value extracts nothing again)"
        for section, names in STAGE_NAMES.items()
        for new, old in names.items()
        if isinstance(config.get(section), dict) and old in config[section]
    ]
    if found:
        raise ConfigError("this config sets a renamed key:\n  " + "\n  ".join(found))


def chat_template_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    """generate.chat_template_kwargs: the benchmark and write_prompts format their prompts as
    generate formats the training prompts."""
    return sorted_keys(config["generate"]["chat_template_kwargs"])


def baseline_workload(config: dict[str, Any]) -> dict[str, Any]:
    """What the verifier alone is measured on: the typed benchmark section's workload
    (Workload.measured: the number of speculative tokens does not shape it), so every draft's
    benchmark reuses it."""
    from eagleflow.benchmark.workload import BenchmarkConfig, Workload

    cfg = typed(BenchmarkConfig, config["benchmark"], "benchmark")
    return Workload.of(cfg, chat_template_kwargs(config)).measured()


def benchmark_sets(config: dict[str, Any]) -> list[dict[str, Any]]:
    """`benchmark.sets`, each entry's keys sorted."""
    return [sorted_keys(entry) for entry in config["benchmark"]["sets"]]


def learning_curve_variants(config: dict[str, Any]) -> list[str]:
    """The variants trained on a subset of the training conversations."""
    return [v for v in variant_overrides(config) if variant_config(config, v)["train"]["sample_fraction"] < 1]


def k_variants(config: dict[str, Any]) -> list[str]:
    """The variants that differ from the config only in benchmark.num_speculative_tokens: the
    measured checks of the report's k prediction."""
    variants = variant_overrides(config)
    first = next(iter(variants))
    return [v for v, o in variants.items() if v != first and set(o) == {"benchmark"}]


def variant_method(config: dict[str, Any], variant: str):
    """The DraftMethod of a variant's draft (train/methods/)."""
    from eagleflow.train.methods import draft_method

    return draft_method(variant_config(config, variant)["train"]["method"])


def draft_serving(config: dict[str, Any], variant: str) -> dict[str, Any]:
    """How vLLM serves a variant's draft (the benchmark's speculative config): its method's name
    and Serving (train/methods/). Data, not code the benchmark imports: a method's serving
    edited reruns its variants' benchmarks, and nothing of the draft's code does."""
    return variant_method(config, variant).served()


def acceptance_estimate(config: dict[str, Any], variant: str) -> str:
    """How training estimates the acceptance length of a variant's draft (its method's
    `estimate`), in the words the report prints."""
    return variant_method(config, variant).estimate


def gpus(config: dict[str, Any], stage: str) -> int:
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
    if stage == "train":
        return config["train"]["gpus"] + served_host_gpus(config)
    return config[stage]["gpus"]


def served_host_gpus(config: dict[str, Any]) -> int:
    """GPUs of the extraction servers a served-mode train job launches on its own host."""
    hs = config["hidden_states"]
    served = hs["served"]
    if hs["mode"] != "served" or served["endpoints"] or served["placement"] != "host":
        return 0
    return served["servers"] * config["server"]["gpus"]


def train_nodes(config: dict[str, Any]) -> int:
    """Nodes the train job asks SLURM for (the `nodes` resource): its own, and in served mode
    with placement: nodes one more for each server it launches (train/served_servers.py)."""
    served = config["hidden_states"]["served"]
    on_nodes = served["placement"] == "nodes" and not served["endpoints"]
    return 1 + served["servers"] if config["hidden_states"]["mode"] == "served" and on_nodes else 1


def hidden_states_server(config: dict[str, Any], verifier_argv: Sequence[str]) -> list[list[str]]:
    """The verifier server's result flags, for the vllm backend only: a server setting must
    not restale states that transformers extracted."""
    return result_args(verifier_argv) if config["hidden_states"]["backend"] == "vllm" else []


def measured_server(config: dict[str, Any], verifier_argv: Sequence[str]) -> dict[str, Any]:
    """What a benchmark measures the verifier's server as: every flag it is launched with
    (speed counts here, so tensor parallelism and eager mode do) but its port and the
    verifier's path, and its environment."""
    argv = [a for flag in server_args(verifier_argv) if flag[0] not in ("--port", "--model") for a in flag]
    return {"argv": argv, "env": sorted_keys(config["server"]["env"])}


def verifier_source(config: dict[str, Any]) -> dict[str, Any]:
    """Where the verifier's weights come from (what prepare_verifier's output depends on)."""
    return {key: config["verifier"][key] for key in ("source", "path")}


def generate_section(config: dict[str, Any]):
    """The `generate` section, typed (runtime.generate_config.GenerateConfig)."""
    from eagleflow.runtime.generate_config import GenerateConfig

    return typed(GenerateConfig, config["generate"], "generate")


def generate_requests(config: dict[str, Any]) -> dict[str, Any]:
    """What generate asks the verifier: the settings that change a request."""
    generate = generate_section(config)
    return sorted_keys(
        {
            "model": config["server"]["served_model_name"],
            "sampling": generate.sampling(),
            "chat_template_kwargs": generate.chat_template_kwargs,
        }
    )


def written_section(config: dict[str, Any]) -> dict[str, Any]:
    """`prompts.written` as write_prompts' param: the filters, weights and split are not in
    it, so changing them sends no request."""
    return sorted_keys(config["prompts"]["written"])


def written_replies(config: dict[str, Any]) -> dict[str, Any] | None:
    """generate's requests, for the replies between written turns; none for one turn."""
    return generate_requests(config) if config["prompts"]["written"]["turns"] > 1 else None


def overlap_sets(config: dict[str, Any]) -> list[dict[str, Any]]:
    """The benchmark sets whose items a training prompt must not resemble: MT-Bench and
    HumanEval always (bench/standard_sets.py measures any run's draft on them, whatever
    benchmark.sets holds), and benchmark.sets' prompt files; none with the filter off."""
    if config["prompts"]["filters"]["benchmark_overlap"] is None:
        return []
    files = [{"name": e["name"], "path": e["path"]} for e in config["benchmark"]["sets"] if e.get("path")]
    return [{"name": "mt_bench"}, {"name": "humaneval"}, *files]


def generate_shards(config: dict[str, Any]) -> list[str]:
    """The generate jobs' names (runtime/response_store.py, generate/run.py: Shard): `<i>-of-<n>`."""
    n = generate_section(config).shards
    return [f"{i}-of-{n}" for i in range(n)]


def synth_parsing(config: dict[str, Any]) -> dict[str, Any]:
    """How synth reads replies; none of it reaches a request."""
    synth = config["synth"]
    return {
        "expect_reasoning": synth["expect_reasoning"],
        "think_markers": synth["think_markers"],
        "chat_template_kwargs": config["generate"]["chat_template_kwargs"],
        "verify_token_ids": synth["verify_token_ids"],
        "trust_remote_code": config["verifier"]["trust_remote_code"],
    }


def served_states(config: dict[str, Any], verifier_argv: Sequence[str]) -> dict[str, Any] | None:
    """Served mode: what shapes the states the train job is sent (the aux layers, the storage
    dtype they are rounded to, the server's result flags). None otherwise, so that no served
    setting restales an offline train job. How they travel (hidden_states.served) the job reads
    from the config: it changes no state."""
    hs = config["hidden_states"]
    if hs["mode"] != "served":
        return None
    if hs["target"] != "final_state":
        raise ConfigError(
            "hidden_states.target: topk makes stored states smaller; hidden_states.mode: served stores none "
            "and trains on the final state (set target: final_state, or mode: offline)"
        )
    served = hs["served"]
    if served["endpoints"] and served["transfer"] == "mooncake" and not served["mooncake"]["master"]:
        raise ConfigError(
            "hidden_states.served.endpoints with transfer: mooncake: set hidden_states.served.mooncake.master "
            "to the master those servers put the states into"
        )
    if served["placement"] == "nodes" and served["transfer"] != "mooncake":
        raise ConfigError(
            "hidden_states.served.placement: nodes runs the servers on other nodes than the trainer, and the "
            "file transfer reads the server's files on one host: set transfer: mooncake"
        )
    return {
        "aux_layer_ids": hs["aux_layer_ids"],
        "dtype": hs["dtype"],
        "trust_remote_code": config["verifier"]["trust_remote_code"],
        "server_args": result_args(verifier_argv),
    }


def online_states(config: dict[str, Any]) -> dict[str, Any] | None:
    """Online mode: the hidden_states settings the train job computes states with. None
    offline, so that no hidden_states setting restales an offline train job."""
    hs = config["hidden_states"]
    if hs["mode"] != "online":
        return None
    keys = ("aux_layer_ids", "dtype", "compute_dtype", "batch_tokens")
    return {k: hs[k] for k in keys} | {"trust_remote_code": config["verifier"]["trust_remote_code"]}
