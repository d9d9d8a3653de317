"""What a hidden-state backend is, and the registry that maps `hidden_states.backend` to one."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from workflow_scripts.common.server import ServerConfig
from workflow_scripts.hidden_states.layers import States, VerifierGeometry

log = logging.getLogger(__name__)


class Backend(Protocol):
    """Runs the verifier over samples and returns each sample's unpadded states, in order."""

    def extract(self, samples: list[dict[str, Any]]) -> list[States]: ...


@dataclass(frozen=True)
class VllmExtractionConfig:
    """`hidden_states.vllm`: the vllm backend's own settings."""

    endpoint: str | None
    storage_dir: str | None
    concurrency: int | str
    adaptive_concurrency: bool
    request_timeout_s: float


@dataclass(frozen=True)
class HiddenStatesConfig:
    """The `hidden_states` config section."""

    backend: str
    num_shards: int
    aux_layer_ids: tuple[int, ...] | None
    dtype: str
    gpus: int
    device: str
    compute_dtype: str
    batch_tokens: int
    vllm: VllmExtractionConfig


@dataclass(frozen=True)
class ExtractionJob:
    """What every backend needs, whatever runs the verifier."""

    verifier_dir: str
    aux_layer_ids: list[int]
    geometry: VerifierGeometry
    store_dtype: torch.dtype
    settings: HiddenStatesConfig
    server: ServerConfig | None  # None for backends that launch no server (hf)
    trust_remote_code: bool
    log_path: str | None
    threads: int


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
