"""One shard job: pick the shard's samples, check the disk, run the configured backend and
write the shard."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

from eagleflow.common.cache_keys import extraction_stack
from eagleflow.common.config import typed
from eagleflow.common.server_args import result_args

# Importing a backend registers it. hf_server runs in its own process (the hf backend's
# server); imported here so that an edit to it restales the shards (common.fingerprint).
from eagleflow.hidden_states import hf, hf_server, vllm  # noqa: F401
from eagleflow.hidden_states.backend import ExtractionJob, HiddenStatesConfig, open_backend
from eagleflow.hidden_states.layers import resolve_aux_layer_ids, verifier_geometry
from eagleflow.hidden_states.shard_file import ShardMeta, write_shard
from eagleflow.hidden_states.shards import (
    check_disk_space,
    samples_for_shard,
    shard_key,
)
from eagleflow.hidden_states.storage import extraction_dtype, num_stored_states, torch_dtype
from eagleflow.hidden_states.targets import TopkHead, head_device
from eagleflow.runtime.cache_plan import clear_mark
from eagleflow.runtime.output_cache import OutputCache
from eagleflow.runtime.smk import stage
from eagleflow.runtime.spec import ServerConfig, ServerSpec

log = logging.getLogger(__name__)


def main(smk) -> None:
    """The hidden_states rule's job (workflow/rules/hidden_states.smk): one shard."""
    # The job's GPUs go to the phase's shared server: the job that launches it claims them for
    # it (runtime.shared_server.SharedServer); the jobs that attach use the server's.
    with stage(smk, claim_gpus=False):
        settings = typed(HiddenStatesConfig, smk.params.hidden_states, "hidden_states")
        run_shard(
            smk.input.train,
            smk.input.eval,
            smk.input.verifier,
            int(smk.wildcards.shard),
            smk.output[0],
            settings=settings,
            # The vllm backend's server; the hf backend has none, and no server setting restales
            # what transformers extracted.
            server=ServerConfig.from_section(smk.config["server"]) if settings.backend == "vllm" else None,
            threads=smk.threads,
            gpus=int(smk.resources.get("gpu", 0) or 0),
            trust_remote_code=smk.params.trust_remote_code,
            log_path=smk.log[0],
            code=smk.params.code,
        )


# Settings that cannot change a shard's bytes: a change of these must not redo an extraction.
OPERATIONAL = {"mode", "num_shards", "linger_s", "gpus", "vllm"}


def content_settings(
    settings: HiddenStatesConfig,
    server_args: list[list[str]] | None,
    layer_ids: list[int],
    trust_remote_code: bool,
    code: str,
    stack: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The settings a shard's bytes depend on (the shard cache's key): `server_args`, the
    result flags of the vllm backend's server as launched (common.server_args; None for hf),
    and the `stack` that computes them (common.cache_keys.extraction_stack). Pure."""
    return {
        "stack": stack,
        "hidden_states": {k: v for k, v in dataclasses.asdict(settings).items() if k not in OPERATIONAL},
        "server": server_args,
        "aux_layer_ids": layer_ids,
        "trust_remote_code": trust_remote_code,
        "code": code,
    }


def run_shard(
    train: str,
    eval_: str,
    verifier_dir: str,
    shard: int,
    out: str,
    *,
    settings: HiddenStatesConfig,
    server: ServerConfig | None,
    threads: int,
    gpus: int,
    trust_remote_code: bool,
    log_path: str,
    code: str = "",
) -> None:
    """Extract shard `shard` of `settings.num_shards` with the configured backend, or link it
    back from the shard cache when it was made from the same inputs before."""
    num_shards = settings.num_shards
    samples = samples_for_shard(train, eval_, shard, num_shards)
    if not samples:
        raise ValueError(f"shard {shard} of {num_shards} has no samples: lower hidden_states.num_shards")
    geometry = verifier_geometry(verifier_dir)
    layer_ids = resolve_aux_layer_ids(settings.aux_layer_ids, geometry)
    # Snakemake removes every output of a failed group job (under SLURM all shard jobs are one
    # group), and restales shards when a setting that cannot change them changes (linger_s,
    # concurrency) or an upstream file is rewritten with the same bytes.
    cache = OutputCache(Path(out).parent / ".done", f"shard-{shard:05d}")
    server_args = result_args(ServerSpec.from_config(server, verifier_dir).command(0)) if server else None
    stack = extraction_stack(settings.backend, settings.device, server.env if server else None)
    key = shard_key(
        samples, verifier_dir, content_settings(settings, server_args, layer_ids, trust_remote_code, code, stack)
    )
    if cache.restore(key, {"shard": out}):
        log.info("shard %d/%d: made from the same inputs before; linked from %s", shard, num_shards, cache.dir)
        return
    # The backends hand over states in the extraction dtype; fp8 is quantized on write.
    store_dtype = torch_dtype(extraction_dtype(settings.dtype))
    num_tokens = sum(len(s["input_ids"]) for s in samples)
    topk = settings.target_topk
    check_disk_space(
        Path(out).parent,
        num_tokens,
        len(samples),
        num_stored_states(len(layer_ids), topk),
        geometry.hidden_size,
        settings.dtype,
        topk,
    )
    job = ExtractionJob(
        verifier_dir, layer_ids, geometry, store_dtype, settings, server, trust_remote_code, log_path, threads, gpus
    )
    backend_name = settings.backend
    started = time.monotonic()
    with open_backend(backend_name, job) as backend:
        states = backend.extract(samples)
    targets = None
    if topk:  # the compact target: the verifier's top-k logits replace the final state
        head = TopkHead(verifier_dir, topk, head_device(settings.device))
        targets = [head(final) for _, final in states]
    ids = [s["id"] for s in samples]
    meta = ShardMeta(ids, layer_ids, geometry.num_layers, geometry.hidden_size, backend_name, made_from=key)
    write_shard(out, samples, states, meta, settings.dtype, targets)
    cache.keep(key, {"shard": out})
    clear_mark([out])
    log.info(
        "shard %d/%d (%s): %d samples, %d tokens in %.1f s -> %s",
        shard,
        num_shards,
        backend_name,
        len(samples),
        num_tokens,
        time.monotonic() - started,
        out,
    )
