"""The `generate` config section, typed: what is asked of the verifier (the requests, which
shape every reply) and how (the client, which never does). The DAG reads the first into the
generate rule's param (rule_params.generate_requests); the jobs read the second from the
config (runtime.answers.Client), so changing how requests are sent reruns no rule."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GenerateConfig:
    """The `generate` section."""

    concurrency: int | str  # the ceiling, or "auto"
    adaptive_concurrency: bool
    max_tokens: int
    temperature: float | None
    top_p: float | None
    seed: int | None
    chat_template_kwargs: dict[str, Any]
    extra_body: dict[str, Any]  # extra request fields (top_k, repetition_penalty, ...)
    request_timeout_s: float
    max_attempts: int
    store: str | None  # the response store's path; None: the run's own
    store_locking: str  # auto | exclusive | shared
    shards: int  # generate jobs

    def sampling(self) -> dict[str, Any]:
        """The request's sampling fields: the ones set, then extra_body's. Pure."""
        fields = {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
        }
        return {k: v for k, v in fields.items() if v is not None} | self.extra_body
