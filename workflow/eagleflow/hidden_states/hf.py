"""The `hf` backend: the transformers forward of hidden_states.forward, run in the phase's
extraction server (hidden_states.hf_server), which loads the verifier once for every shard
job; a shard job sends it its token-budget batches."""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from eagleflow.hidden_states.backend import ExtractionJob, register_backend, sharing, storage_dir
from eagleflow.hidden_states.client import ExtractionClient
from eagleflow.hidden_states.forward import token_budget_batches
from eagleflow.hidden_states.layers import States
from eagleflow.hidden_states.storage import extraction_dtype
from eagleflow.runtime.concurrency import Concurrency
from eagleflow.runtime.serving import launched
from eagleflow.runtime.spec import spec_key

log = logging.getLogger(__name__)


# Restarts of the phase's server after it died; transformers loads either work or raise.
MAX_RESTARTS = 3
# A wedged load (a hung filesystem) is the only thing this bound catches.
STARTUP_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class HfServerSpec:
    """How the phase's hf extraction server is started (runtime.spec.Launchable)."""

    name: ClassVar[str] = "hf extraction server"
    model: str
    aux_layer_ids: tuple[int, ...]
    device: str
    compute_dtype: str
    store_dtype: str
    threads: int
    trust_remote_code: bool
    storage_dir: str = ""
    host: str = "127.0.0.1"
    env: dict[str, str] = field(default_factory=dict)
    startup_timeout_s: float = STARTUP_TIMEOUT_S
    port: int | None = None
    stop_grace_s: float = 20.0

    @property
    def scratch_dirs(self) -> tuple[str, ...]:
        return (self.storage_dir,) if self.storage_dir else ()

    def check(self) -> None:
        """transformers loads what the stage can read; its errors name the problem."""

    def command(self, port: int) -> list[str]:
        cmd = [
            sys.executable,
            "-m",
            "eagleflow.hidden_states.hf_server",
            "--model",
            self.model,
            "--host",
            self.host,
            "--port",
            str(port),
            "--aux-layer-ids",
            json.dumps(list(self.aux_layer_ids)),
            "--device",
            self.device,
            "--compute-dtype",
            self.compute_dtype,
            "--store-dtype",
            self.store_dtype,
            "--storage-dir",
            self.storage_dir,
            "--threads",
            str(self.threads),
        ]
        return cmd + (["--trust-remote-code"] if self.trust_remote_code else [])


@dataclass
class HfBackend:
    """A shard job's side: the shard's token-budget batches, one request each."""

    client: ExtractionClient
    batch_tokens: int

    def extract(self, samples: list[dict[str, Any]], batches: list[list[int]] | None = None) -> list[States]:
        lengths = [len(s["input_ids"]) for s in samples]
        return self.client.extract(samples, token_budget_batches(lengths, self.batch_tokens))


@register_backend("hf")
@contextlib.contextmanager
def hf_backend(job: ExtractionJob) -> Iterator[HfBackend]:
    settings = job.settings
    spec = HfServerSpec(
        model=job.verifier_dir,
        aux_layer_ids=tuple(job.aux_layer_ids),
        device=settings.device,
        compute_dtype=settings.compute_dtype,
        store_dtype=extraction_dtype(settings.dtype),
        threads=job.threads,
        trust_remote_code=job.trust_remote_code,
    )
    spec = replace(spec, storage_dir=str(storage_dir(None, spec_key(spec), job)))
    with launched(spec, job.log_path, MAX_RESTARTS, sharing(job)) as server:
        client = ExtractionClient(
            base_url=server.url,
            served_model_name="hf",
            num_aux=len(job.aux_layer_ids),
            hidden_size=job.geometry.hidden_size,
            store_dtype=job.store_dtype,
            # Two requests in flight: the server computes one batch while this job reads the last.
            limit=Concurrency(2, adaptive=False, name="hidden states"),
            request_timeout_s=STARTUP_TIMEOUT_S,
            recovery=server.recovery,
            what="transformers",
        )
        yield HfBackend(client, settings.batch_tokens)
