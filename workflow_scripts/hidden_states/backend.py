"""What a hidden-state backend is, and the registry that maps `hidden_states.backend` to one."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from workflow_scripts.hidden_states.layers import States, VerifierGeometry

log = logging.getLogger(__name__)


class Backend(Protocol):
    """Runs the verifier over samples and returns each sample's unpadded states, in order."""

    def extract(self, samples: list[dict[str, Any]]) -> list[States]: ...


@dataclass(frozen=True)
class ExtractionJob:
    """What every backend needs, whatever runs the verifier."""

    verifier_dir: str
    aux_layer_ids: list[int]
    geometry: VerifierGeometry
    store_dtype: torch.dtype
    settings: dict[str, Any]  # the hidden_states config section
    server: dict[str, Any] = field(default_factory=dict)  # the server config section
    trust_remote_code: bool = False
    log_path: str | None = None
    threads: int = 1


BackendFactory = Callable[[ExtractionJob], contextlib.AbstractContextManager[Backend]]
BACKENDS: dict[str, BackendFactory] = {}


def register_backend(name: str) -> Callable[[BackendFactory], BackendFactory]:
    def add(factory: BackendFactory) -> BackendFactory:
        BACKENDS[name] = factory
        return factory

    return add


def open_backend(name: str, job: ExtractionJob) -> contextlib.AbstractContextManager[Backend]:
    try:
        factory = BACKENDS[name]
    except KeyError:
        raise ValueError(f"hidden_states.backend is {name!r}; known backends: {sorted(BACKENDS)}") from None
    return factory(job)
