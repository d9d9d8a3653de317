"""The `vllm` backend: vLLM's `extract_hidden_states` speculative method with its
hidden-states KV connector, for verifiers only vLLM can serve (INT4 MoE, tensor parallel 8)."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from workflow_scripts.common.client import ChatClient, RequestFailed
from workflow_scripts.common.concurrency import Concurrency, parse_ceiling
from workflow_scripts.common.server import Recovery, ServerSpec, serve
from workflow_scripts.hidden_states.backend import ExtractionJob, register_backend
from workflow_scripts.hidden_states.layers import States, vllm_layer_ids

log = logging.getLogger(__name__)
# vLLM (checked against 0.32.0) extracts hidden states as a speculative "method": the
# ExtractHiddenStatesModel drafter writes the verifier's aux states for every scheduled
# token into a cache-only KV layer, and ExampleHiddenStatesConnector copies a finished
# request's slots to `<shared_storage_path>/<request id>.safetensors` holding
# `hidden_states` [prompt tokens, len(layer ids), hidden] (layer order, model dtype) and
# `token_ids` [prompt tokens]. It holds LOCK_EX on `<file>.lock` until the write is done;
# the completion response names the file in `kv_transfer_params.hidden_states_path`.
# Layer id L (num_layers) is the last layer's output before the final norm.

CONNECTOR = "ExampleHiddenStatesConnector"


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
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": storage_dir},
    }
    # Prefix caching would let a request reuse another's cached blocks; every token's
    # states are computed and written per request instead.
    return speculative_config, ["--kv-transfer-config", json.dumps(kv_transfer_config), "--no-enable-prefix-caching"]


def completion_request(input_ids: list[int], served_model_name: str) -> dict[str, Any]:
    """A completion over exactly the sample's tokens (no chat template, no BOS added): the
    prefill computes every token's states; one generated token ends the request."""
    return {
        "model": served_model_name,
        "prompt": list(input_ids),
        "max_tokens": 1,
        "temperature": 0.0,
        "kv_transfer_params": {"include_output_tokens": False},
    }


class HiddenStatesFileError(RuntimeError):
    """The connector's output for a sample is missing, late or does not match the sample."""


def wait_for_unlock(lock_path: Path, timeout_s: float) -> None:
    """Block until the connector released its exclusive lock (the write is complete)."""
    # The connector creates the lock (holding LOCK_EX) before the reply names the file;
    # no lock file means it runs with use_synchronization_lock off.
    deadline = time.monotonic() + timeout_s
    try:
        fh = open(lock_path)  # noqa: SIM115 (closed by the `with` below; a missing file is an answer)
    except FileNotFoundError:
        return
    with fh:
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_SH | fcntl.LOCK_NB)
                fcntl.flock(fh, fcntl.LOCK_UN)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise HiddenStatesFileError(f"{lock_path}: vLLM still writing after {timeout_s:.0f} s") from None
                time.sleep(0.05)


def split_states(stacked: torch.Tensor, num_aux: int) -> States:
    """[tokens, num_aux + 1, hidden] in layer order -> (aux [tokens, num_aux * hidden], final). Pure."""
    tokens, states, hidden = stacked.shape
    if states != num_aux + 1:
        raise HiddenStatesFileError(f"expected {num_aux + 1} states per token, got {states}")
    return stacked[:, :num_aux].reshape(tokens, num_aux * hidden), stacked[:, num_aux]


def read_connector_output(
    path: str, sample: dict[str, Any], num_aux: int, hidden_size: int, store_dtype: torch.dtype, timeout_s: float
) -> States:
    """Read, check and delete one request's hidden-states file."""
    from safetensors.torch import load_file

    file = Path(path)
    lock = Path(f"{path}.lock")
    wait_for_unlock(lock, timeout_s)
    if not file.exists():
        raise HiddenStatesFileError(
            f"sample {sample['id']}: vLLM named {file} but it does not "
            "exist (is shared_storage_path on a filesystem this job sees?)"
        )
    data = load_file(str(file))
    token_ids = data["token_ids"].tolist()
    if token_ids != list(sample["input_ids"]):
        raise HiddenStatesFileError(
            f"sample {sample['id']}: {file} holds {len(token_ids)} tokens that "
            f"differ from the sample's {len(sample['input_ids'])} input_ids"
        )
    stacked = data["hidden_states"]
    if stacked.dim() != 3 or stacked.shape[0] != len(token_ids) or stacked.shape[2] != hidden_size:
        raise HiddenStatesFileError(
            f"sample {sample['id']}: {file} has hidden_states {tuple(stacked.shape)}, "
            f"expected ({len(token_ids)}, {num_aux + 1}, {hidden_size})"
        )
    aux, final = split_states(stacked.to(store_dtype), num_aux)
    file.unlink()
    lock.unlink(missing_ok=True)
    return aux, final


@dataclass
class VllmBackend:
    base_url: str
    served_model_name: str
    num_aux: int
    hidden_size: int
    store_dtype: torch.dtype
    limit: Concurrency
    request_timeout_s: float
    recovery: Recovery
    api_key_env: str | None = None

    async def _one(self, client: ChatClient, sample: dict[str, Any]) -> States:
        try:
            body = await client.completion(completion_request(sample["input_ids"], self.served_model_name))
        except RequestFailed as exc:
            raise HiddenStatesFileError(f"sample {sample['id']}: /v1/completions failed: {exc}") from exc
        path = (body.get("kv_transfer_params") or {}).get("hidden_states_path")
        if not path:
            raise HiddenStatesFileError(
                f"sample {sample['id']}: the reply of {self.base_url} has no kv_transfer_params.hidden_states_path: "
                f"the server does not run the extract_hidden_states method with {CONNECTOR}"
            )
        # Waiting on the connector's lock and reading the file block: a worker thread does it
        # while the other requests keep flowing.
        return await asyncio.to_thread(
            read_connector_output,
            path,
            sample,
            self.num_aux,
            self.hidden_size,
            self.store_dtype,
            self.request_timeout_s,
        )

    def extract(self, samples: list[dict[str, Any]]) -> list[States]:
        return asyncio.run(self._extract(samples))

    async def _extract(self, samples: list[dict[str, Any]]) -> list[States]:
        bar = tqdm(
            total=sum(len(s["input_ids"]) for s in samples),
            desc="hidden states (vLLM)",
            unit="tok",
            unit_scale=True,
            mininterval=2.0,
        )
        client = ChatClient(
            self.base_url,
            concurrency=self.limit.ceiling,
            request_timeout_s=self.request_timeout_s,
            api_key_env=self.api_key_env,
            limit=self.limit,
            recovery=self.recovery,
        )

        async def one(sample: dict[str, Any]) -> States:
            states = await self._one(client, sample)
            bar.update(len(sample["input_ids"]))
            return states

        async with client:
            # The limit admits the requests; reading a reply's file happens outside its slot.
            tasks = [asyncio.create_task(one(s)) for s in samples]
            try:
                return list(await asyncio.gather(*tasks))
            except BaseException:
                # Fail now: cancel what has not finished, and let it unwind before the client closes.
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
            finally:
                bar.close()


@register_backend("vllm")
@contextlib.contextmanager
def vllm_backend(job: ExtractionJob) -> Iterator[VllmBackend]:
    """Launch vLLM with the extraction method (through the one server launcher), or use an
    already running one (`hidden_states.vllm.endpoint`, started with the same layer ids and
    a storage path this job can read)."""
    if job.server is None:
        raise ValueError("the vllm hidden-state backend needs the server section (rules pass it for backend vllm)")
    opts = job.settings.vllm
    storage_parent = opts.storage_dir
    if storage_parent:
        Path(storage_parent).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="eagleflow-hs-", dir=storage_parent) as storage_dir:
        speculative_config, extra = extraction_server_args(job.aux_layer_ids, job.geometry.num_layers, storage_dir)
        spec = ServerSpec.from_config(job.server, job.verifier_dir)
        trust = (
            ["--trust-remote-code"] if job.trust_remote_code and "--trust-remote-code" not in spec.extra_args else []
        )
        spec = replace(spec, speculative_config=speculative_config, extra_args=(*spec.extra_args, *extra, *trust))
        # The server's log goes next to the rule's log.
        log_path = Path(job.log_path).with_suffix(".vllm.log") if job.log_path else Path(storage_dir) / "vllm.log"
        with serve(spec, log_path, job.server, opts.endpoint) as served:
            yield VllmBackend(
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
