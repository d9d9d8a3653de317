"""The `prompts` config section, typed (workflow/schemas/config.schema.yaml holds its defaults and meaning)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FilterConfig:
    """The `prompts.filters` config section."""

    min_chars: int
    max_chars: int
    min_text_score: float
    near_duplicate: float | None
    benchmark_overlap: float | None


@dataclass(frozen=True)
class WrittenConfig:
    """`prompts.written`: the conversations the verifier writes itself."""

    count: int
    turns: int
    system: str | None
    hints: tuple[str, ...]
    hint_prompt: str
    temperature: float
    top_p: float
    max_tokens: int
    seed: int


@dataclass(frozen=True)
class Weights:
    """`prompts.weights`: each source's share of the prompt set."""

    file: float
    written: float


@dataclass(frozen=True)
class PromptsConfig:
    """The `prompts` config section."""

    source: str | None
    eval_fraction: float
    seed: int
    max_train: int | None
    max_eval: int | None
    written: WrittenConfig
    weights: Weights
    filters: FilterConfig
