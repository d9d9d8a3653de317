"""The client side of an extraction server, for both backends: requests over a sample's
token ids, and the per-sample states files the server names in its reply.

The protocol is vLLM's `extract_hidden_states` method with its ExampleHiddenStatesConnector
(checked against vLLM 0.32.0): a completion over exactly the sample's tokens (no chat
template, no BOS added, one generated token) makes the server write
`<storage>/<request id>.safetensors` holding `hidden_states` [prompt tokens, len(layer ids),
hidden] (layer order, model dtype) and `token_ids` [prompt tokens]. vLLM holds LOCK_EX on
`<file>.lock` until the write is done; the reply names the file in
`kv_transfer_params.hidden_states_path`. The hf backend's own server (hidden_states.hf_server)
writes the same files, for a batch of samples per request (`hidden_states_paths`, in the
request's order), so that its forward batches are the ones the token budget makes.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from eagleflow.hidden_states.layers import States
from eagleflow.runtime.client import ChatClient, RequestFailed
from eagleflow.runtime.concurrency import Concurrency
from eagleflow.runtime.recovery import Recovery

log = logging.getLogger(__name__)


class HiddenStatesFileError(RuntimeError):
    """The server's output for a sample is missing, late or does not match the sample."""


def completion_request(prompt: list[int] | list[list[int]], served_model_name: str) -> dict[str, Any]:
    """A completion over exactly the sample's tokens (or, for the hf server, several
    samples'): the prefill computes every token's states; one generated token ends it."""
    return {
        "model": served_model_name,
        "prompt": [list(p) for p in prompt] if prompt and isinstance(prompt[0], list) else list(prompt),
        "max_tokens": 1,
        "temperature": 0.0,
        "kv_transfer_params": {"include_output_tokens": False},
    }


def states_paths(body: dict[str, Any], expected: int) -> list[str] | None:
    """The states files a reply names, one per sample of the request; None if it names none. Pure."""
    params = body.get("kv_transfer_params") or {}
    paths = params.get("hidden_states_paths") or (
        [params["hidden_states_path"]] if params.get("hidden_states_path") else None
    )
    if paths is not None and len(paths) != expected:
        raise HiddenStatesFileError(f"the reply names {len(paths)} states files for {expected} samples")
    return paths


def wait_for_unlock(lock_path: Path, timeout_s: float) -> None:
    """Block until the connector released its exclusive lock (the write is complete)."""
    # The connector creates the lock (holding LOCK_EX) before the reply names the file;
    # no lock file means it runs with use_synchronization_lock off (or wrote atomically).
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


def stack_states(aux: torch.Tensor, final: torch.Tensor) -> torch.Tensor:
    """The inverse of split_states: (aux [tokens, n * hidden], final [tokens, hidden]) ->
    [tokens, n + 1, hidden], the layout of a connector file. Pure."""
    tokens, hidden = final.shape
    return torch.cat([aux.reshape(tokens, -1, hidden), final[:, None]], dim=1)


def read_connector_output(
    path: str, sample: dict[str, Any], num_aux: int, hidden_size: int, store_dtype: torch.dtype, timeout_s: float
) -> States:
    """Read, check and delete one sample's hidden-states file."""
    from safetensors.torch import load_file

    file = Path(path)
    lock = Path(f"{path}.lock")
    wait_for_unlock(lock, timeout_s)
    if not file.exists():
        raise HiddenStatesFileError(
            f"sample {sample['id']}: the server named {file} but it does not "
            "exist (is the storage directory on a filesystem this job sees?)"
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
class ExtractionClient:
    """A shard's samples through an extraction server: one request per sample (vLLM), or
    per batch of samples (`batches`, sample indices; the hf server)."""

    base_url: str
    served_model_name: str
    num_aux: int
    hidden_size: int
    store_dtype: torch.dtype
    limit: Concurrency
    request_timeout_s: float
    recovery: Recovery
    api_key_env: str | None = None
    what: str = "vLLM"

    async def _batch(self, client: ChatClient, samples: list[dict[str, Any]], batched: bool) -> list[States]:
        prompt = [s["input_ids"] for s in samples] if batched else samples[0]["input_ids"]
        ids = ", ".join(s["id"] for s in samples[:3]) + (", ..." if len(samples) > 3 else "")
        try:
            body = await client.completion(completion_request(prompt, self.served_model_name))
        except RequestFailed as exc:
            raise HiddenStatesFileError(f"sample {ids}: /v1/completions failed: {exc}") from exc
        paths = states_paths(body, len(samples))
        if not paths:
            raise HiddenStatesFileError(
                f"sample {ids}: the reply of {self.base_url} has no kv_transfer_params.hidden_states_path: "
                "the server does not run the extract_hidden_states method with ExampleHiddenStatesConnector"
            )
        # Waiting on the connector's lock and reading the files block: a worker thread does it
        # while the other requests keep flowing.
        return [
            await asyncio.to_thread(
                read_connector_output,
                path,
                sample,
                self.num_aux,
                self.hidden_size,
                self.store_dtype,
                self.request_timeout_s,
            )
            for path, sample in zip(paths, samples, strict=True)
        ]

    def extract(self, samples: list[dict[str, Any]], batches: list[list[int]] | None = None) -> list[States]:
        return asyncio.run(self._extract(samples, batches))

    async def _extract(self, samples: list[dict[str, Any]], batches: list[list[int]] | None) -> list[States]:
        groups = batches if batches is not None else [[i] for i in range(len(samples))]
        bar = tqdm(
            total=sum(len(s["input_ids"]) for s in samples),
            desc=f"hidden states ({self.what})",
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
        out: list[States | None] = [None] * len(samples)

        async def one(group: list[int]) -> None:
            states = await self._batch(client, [samples[i] for i in group], batched=batches is not None)
            for i, s in zip(group, states, strict=True):
                out[i] = s
            bar.update(sum(len(samples[i]["input_ids"]) for i in group))

        async with client:
            # The limit admits the requests; reading a reply's files happens outside its slot.
            tasks = [asyncio.create_task(one(g)) for g in groups]
            try:
                await asyncio.gather(*tasks)
            except BaseException:
                # Fail now: cancel what has not finished, and let it unwind before the client closes.
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
            finally:
                bar.close()
        return out  # type: ignore[return-value]
