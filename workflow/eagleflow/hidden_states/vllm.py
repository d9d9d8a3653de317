"""The `vllm` backend: vLLM's `extract_hidden_states` speculative method with its
hidden-states KV connector, for verifiers only vLLM can serve (INT4 MoE, tensor parallel 8)."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from eagleflow.common.fingerprint import runs_module
from eagleflow.hidden_states.backend import ExtractionJob, register_backend, sharing, storage_dir
from eagleflow.hidden_states.client import ExtractionClient
from eagleflow.hidden_states.layers import vllm_layer_ids
from eagleflow.runtime.concurrency import Concurrency, parse_ceiling
from eagleflow.runtime.serving import serve
from eagleflow.runtime.spec import ServerSpec, spec_key

log = logging.getLogger(__name__)
# vLLM (checked against 0.32.0) extracts hidden states as a speculative "method": the
# ExtractHiddenStatesModel drafter writes the verifier's aux states for every scheduled
# token into a cache-only KV layer, and the hidden-states connector copies a finished
# request's slots to a file per request (hidden_states.client describes it). Layer id L
# (num_layers) is the last layer's output before the final norm. The connector is vLLM's
# ExampleHiddenStatesConnector with a write that also runs on a CPU KV cache
# (hidden_states.vllm_connector).

CONNECTOR = "EagleflowHiddenStatesConnector"
# vLLM's engine loads it by this path, in the server's process: declared, so that an edit to
# it changes the stored states' keys (common.fingerprint.runs_module).
CONNECTOR_MODULE = runs_module("eagleflow.hidden_states.vllm_connector")


def extraction_server_args(
    aux_layer_ids: list[int], num_layers: int, storage_dir: str
) -> tuple[dict[str, Any], list[str]]:
    """(speculative config, extra CLI args) that make vLLM write hidden states. Pure."""
    speculative_config = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,  # the only value the method accepts
        "draft_model_config": {
            "hf_config": {"eagle_aux_hidden_state_layer_ids": vllm_layer_ids(aux_layer_ids, num_layers)}
        },
    }
    kv_transfer_config = {
        "kv_connector": CONNECTOR,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": storage_dir},
    }
    # Prefix caching would let a request reuse another's cached blocks; every token's
    # states are computed and written per request instead.
    return speculative_config, ["--kv-transfer-config", json.dumps(kv_transfer_config), "--no-enable-prefix-caching"]


@register_backend("vllm")
@contextlib.contextmanager
def vllm_backend(job: ExtractionJob) -> Iterator[ExtractionClient]:
    """vLLM with the extraction method, the job's own (a hidden-state part) or shared by the
    phase's jobs (parity: launched by the first, through the one server launcher), or an
    already running one
    (`hidden_states.vllm.endpoint`, started with the same layer ids and a storage path this
    job can read)."""
    if job.server is None:
        raise ValueError("the vllm hidden-state backend needs the server section (rules pass it for backend vllm)")
    opts = job.settings.vllm
    spec = ServerSpec.from_config(job.server, job.verifier_dir)
    trust = ["--trust-remote-code"] if job.trust_remote_code and "--trust-remote-code" not in spec.extra_args else []
    spec = replace(spec, extra_args=(*spec.extra_args, *trust))
    # The storage directory is named after the server it belongs to, so that every job
    # sharing the server (same spec, same key) names the same one.
    storage = storage_dir(opts.storage_dir, spec_key(spec), job)
    speculative_config, extra = extraction_server_args(job.aux_layer_ids, job.geometry.num_layers, str(storage))
    spec = replace(
        spec,
        speculative_config=speculative_config,
        extra_args=(*spec.extra_args, *extra),
        scratch_dirs=(str(storage),),
    )
    with serve(spec, job.log_path, job.server, opts.endpoint, sharing(job)) as served:
        yield ExtractionClient(
            base_url=served.url if isinstance(served.url, str) else served.url[0],
            served_model_name=spec.served_model_name,
            num_aux=len(job.aux_layer_ids),
            hidden_size=job.geometry.hidden_size,
            store_dtype=job.store_dtype,
            limit=Concurrency(parse_ceiling(opts.concurrency), opts.adaptive_concurrency, name="hidden states"),
            request_timeout_s=opts.request_timeout_s,
            recovery=served.recovery,
            api_key_env=job.server.api_key_env,
        )
