"""Config validation with messages that name the key, what was expected and what was found,
and the typed view of a section that stage code reads.

The Snakefile calls `validate_config` right after loading the config, so a misspelled key
or a wrong type stops `snakemake -n` before any job starts. Every key is required by the
schema and config/config.yaml holds every default (a --configfile is merged over it), so code
never supplies a default: `typed` builds a stage's frozen dataclass from its section and
fails, naming the key, if the two disagree.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from jsonschema import Draft202012Validator

# workflow/schemas/config.schema.yaml (the catalog's place), reached through the package's link
# to it, which an installed package carries as the file itself (pyproject's package data).
SCHEMA_PATH = Path(__file__).parents[1] / "config.schema.yaml"


class ConfigError(ValueError):
    pass


T = TypeVar("T")


def typed(cls: type[T], section: Mapping[str, Any], where: str) -> T:
    """`cls` (a frozen dataclass) from the validated config `section` named `where`.

    Field names are the config keys, all of them: a missing or unknown key is a ConfigError
    naming it. Nested dataclass fields are built from nested sections and lists become
    tuples for tuple fields. Types are the schema's job; this does not check them again.
    """
    names = [f.name for f in dataclasses.fields(cls)]
    missing = [n for n in names if n not in section]
    unknown = sorted(set(section) - set(names))
    if missing or unknown:
        problems = [f"{where}.{n}: missing" for n in missing] + [f"{where}.{n}: unknown key" for n in unknown]
        raise ConfigError(f"{cls.__name__} does not match the config section {where}: {'; '.join(problems)}")
    hints = typing.get_type_hints(cls)
    return cls(**{n: _typed_value(hints[n], section[n], f"{where}.{n}") for n in names})


def _typed_value(hint: Any, value: Any, where: str) -> Any:
    if value is None:
        return None
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in args if a is not type(None))
        args = typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return typed(hint, value, where)
    if typing.get_origin(hint) is tuple:
        return tuple(value)
    return value


def _key_path(error) -> str:
    return ".".join(str(p) for p in error.absolute_path) or "<top level>"


def _describe(error) -> str:
    where = _key_path(error)
    if error.validator == "additionalProperties":
        allowed = sorted(error.schema.get("properties", {}))
        extra = sorted(set(error.instance) - set(allowed))
        prefix = f"{where}." if error.absolute_path else ""
        return f"unknown key {', '.join(prefix + e for e in extra)} (allowed here: {', '.join(allowed)})"
    if error.validator == "required":
        return f"{where}: {error.message}"
    if error.validator in (
        "type",
        "enum",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "pattern",
        "minItems",
    ):
        return f"{where}: expected {_expected(error)}, got {error.instance!r}"
    return f"{where}: {error.message}"


def _expected(error) -> str:
    v, val = error.validator, error.validator_value
    return {
        "type": f"type {val}",
        "enum": f"one of {val}",
        "minimum": f">= {val}",
        "maximum": f"<= {val}",
        "exclusiveMinimum": f"> {val}",
        "exclusiveMaximum": f"< {val}",
        "pattern": f"a string matching {val}",
        "minItems": f"at least {val} item(s)",
    }[v]


# Settings that moved from `synth` to `generate` (what is asked of the verifier, and how):
# `synth` keeps how replies are read.
MOVED_TO_GENERATE = (
    "concurrency",
    "adaptive_concurrency",
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "chat_template_kwargs",
    "extra_body",
    "request_timeout_s",
    "max_attempts",
    "store",
)


def moved_settings(config: dict[str, Any]) -> list[str]:
    """What an older config still sets in a section it moved out of, one line each, with the
    new place. Pure."""
    synth = config.get("synth") or {}
    return [
        f"synth.{key}: moved to generate.{key} (the request settings are the generate stage's); "
        f"move it under `generate:`"
        for key in MOVED_TO_GENERATE
        if isinstance(synth, dict) and key in synth
    ]


def validate_config(config: dict[str, Any], schema_path: Path = SCHEMA_PATH) -> None:
    """Raise ConfigError listing every problem in `config`, one line each."""
    moved = moved_settings(config)
    if moved:
        raise ConfigError(
            f"this config predates the generate section ({len(moved)} settings):\n  " + "\n  ".join(moved)
        )
    schema = yaml.safe_load(schema_path.read_text())
    errors = sorted(Draft202012Validator(schema).iter_errors(config), key=lambda e: list(map(str, e.absolute_path)))
    if errors:
        lines = "\n  ".join(_describe(e) for e in errors)
        raise ConfigError(
            f"invalid eagleflow config ({len(errors)} problem{'s' if len(errors) > 1 else ''}):\n  {lines}"
        )
    prompts = config["prompts"]
    if not prompts["source"] and not prompts["written"]["count"]:
        raise ConfigError("prompts: no source (prompts.source is null and prompts.written.count is 0)")
    if prompts["source"] and prompts["written"]["count"] and not any(prompts["weights"].values()):
        raise ConfigError("prompts.weights: every weight is 0; give the sources a share")
    if config["verifier"]["source"] == "path" and not config["verifier"].get("path"):
        raise ConfigError("verifier.path: required when verifier.source is 'path'")
    aux = config["hidden_states"].get("aux_layer_ids")
    if aux and len(set(aux)) != len(aux):
        raise ConfigError(f"hidden_states.aux_layer_ids: layer ids must be distinct, got {aux}")
    if config["hidden_states"]["mode"] == "online" and config["hidden_states"]["target"] != "final_state":
        raise ConfigError(
            "hidden_states.target: topk makes shards smaller; hidden_states.mode: online writes no shards "
            "and keeps the final state (set target: final_state, or mode: offline)"
        )


def load_config(path: str | Path) -> dict[str, Any]:
    config = yaml.safe_load(Path(path).read_text())
    validate_config(config)
    return config
