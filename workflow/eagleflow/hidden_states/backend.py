"""What a hidden-state backend is, and the registry that maps `hidden_states.backend` to one."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import socket
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from eagleflow.hidden_states.layers import States, VerifierGeometry
from eagleflow.hidden_states.storage import target_topk
from eagleflow.runtime.shared_server import Sharing
from eagleflow.runtime.spec import ServerConfig

log = logging.getLogger(__name__)


class Backend(Protocol):
    """Runs the verifier over samples and returns each sample's unpadded states, in order."""

    def extract(self, samples: list[dict[str, Any]], batches: list[list[int]] | None = None) -> list[States]: ...


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

    mode: str
    backend: str
    # The config's hidden_states.num_parts, by the name this field had (dag.rule_params.STAGE_NAMES):
    # renaming it would change the code that keys every stored sample.
    num_shards: int
    store_every_tokens: int
    aux_layer_ids: tuple[int, ...] | None
    dtype: str
    target: str
    topk: int
    gpus: int
    device: str
    compute_dtype: str
    batch_tokens: int
    linger_s: float
    vllm: VllmExtractionConfig

    @property
    def target_topk(self) -> int:
        """Logits a shard keeps per token instead of the final state; 0: it keeps the state."""
        return target_topk(self.target, self.topk)


@dataclass(frozen=True)
class ExtractionJob:
    """What every backend needs, whatever runs the verifier."""

    verifier_dir: str
    aux_layer_ids: list[int]
    geometry: VerifierGeometry
    store_dtype: torch.dtype  # what backends hand states over in (shards.extraction_dtype)
    settings: HiddenStatesConfig
    server: ServerConfig | None  # the `server` section, for the vllm backend only
    trust_remote_code: bool
    log_path: str  # the job's log; its own server logs into it, a shared one next to it
    threads: int
    gpus: int  # GPUs of the job's server (of the phase's, claimed by the job that launches it)
    # The phase the job's server serves: the hidden-state phase (one job per node, its own
    # server) or the parity jobs' replays (SHARED_PHASES).
    phase: str = "hidden_states"


# Phases whose jobs on one node share one server (runtime.shared_server.SharedServer): the
# parity jobs, one per variant. The hidden-state phase runs one job per node (its samples
# bucketed by hidden_states.sample_keys.part_of), which launches its own.
SHARED_PHASES = frozenset({"parity"})


def sharing(job: ExtractionJob) -> Sharing | None:
    """How the job's phase shares its server; None: the job launches its own."""
    if job.phase not in SHARED_PHASES:
        return None
    return Sharing(name=job.phase, linger_s=job.settings.linger_s, gpus=job.gpus)


def storage_dir(parent: str | None, key: str, job: ExtractionJob) -> Path:
    """Where the server writes per-sample states files: named after the server (`key`), its
    host (one server per host shares a phase), the workflow directory it serves (two runs of
    one config in two directories run two servers) and, for a job's own server, the job (its
    log), so that every job sharing it reads from the same place and no other server's stop
    removes it (ServerSpec.scratch_dirs)."""
    workdir = hashlib.sha256(os.getcwd().encode()).hexdigest()[:8]
    owner = "" if sharing(job) else f"-{Path(job.log_path).stem}"
    path = Path(parent or tempfile.gettempdir()) / f"eagleflow-hs-{key}-{workdir}-{socket.gethostname()}{owner}"
    path.mkdir(parents=True, exist_ok=True)
    return path


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
