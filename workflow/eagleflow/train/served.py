"""Served mode (`hidden_states.mode: served`): the train job trains on states that a vLLM
server extracts as training needs them, and no state is stored anywhere.

The server is the offline vllm backend's: vLLM's `extract_hidden_states` method with the same
aux layer ids and flags (hidden_states.vllm.extraction_server_args), one request per sample
over exactly its tokens. The states cross through an existing transfer engine, hs-connectors'
(`hidden_states.served.transfer`):

- `file`: vLLM's hidden-states connector writes one safetensors file per request into a
  directory on this host (not the results tree) and hs-connectors' FileTransfer reads it
  back, then it is deleted: read-then-delete on one host (eagleflow's connector subclass on a
  CPU: hidden_states.vllm_connector).
- `mooncake`: hs-connectors' Mooncake connector puts the states into Mooncake's store (TCP,
  or RDMA where the cluster has it) and the trainer reads them by the handle the reply
  carries, then removes them: the server may run on another node. The train job starts a
  master unless `.master` names a running one. On a CPU the connector is
  hidden_states.mooncake_connector.

Where the servers run (this host, or nodes of the job's SLURM allocation), how many, and what
the train job starts beside them: train/served_servers.py.

Each sample's states are checked before training sees them: the token ids the server
computed must be the sample's, the shape [tokens, aux + 1, hidden], every value finite. A
sample that fails, or whose states do not arrive within `transfer_timeout_s`, is counted,
logged with its id and asked for again (`retries` times), never trained on. A server that
dies is restarted and the requests in flight are sent again (runtime.client).

The states are turned into training samples exactly as offline training reads them back from
the store (rounded to `hidden_states.dtype`, then float32: storage.as_read_back) and aligned
by the draft method, so the same server flags give the offline draft's data. The feed
(train/feed.py) requests ahead of the steps within `max_inflight_mb`. Every epoch asks the
server again: no state is cached between epochs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import torch

from eagleflow.hidden_states.client import completion_request, split_states
from eagleflow.hidden_states.layers import resolve_aux_layer_ids, verifier_geometry
from eagleflow.hidden_states.storage import as_read_back, extraction_dtype, torch_dtype
from eagleflow.runtime.client import ChatClient
from eagleflow.runtime.spec import ServerConfig
from eagleflow.train.data import Sample, shift
from eagleflow.train.feed import FeedStats, StatesFeed
from eagleflow.train.online import TokenSample
from eagleflow.train.served_servers import (
    MooncakeSettings,
    backing_master,
    open_servers,
    settings_of,
    store_config,
)

log = logging.getLogger(__name__)


class RefusedStates(RuntimeError):
    """A sample's states arrived but cannot be trained on; `kind` counts it."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class TransferTimeout(RuntimeError):
    """A sample's states did not arrive in time."""


class ServedStatesError(RuntimeError):
    """A sample's states could not be had at all."""


def check_states(item: TokenSample, tensors: dict[str, torch.Tensor], num_aux: int, hidden_size: int) -> torch.Tensor:
    """The sample's stacked states [tokens, num_aux + 1, hidden], or RefusedStates: tokens
    not the sample's (`truncated` when fewer, else `mismatch`), a wrong shape (`truncated`),
    a value that is not finite (`nonfinite`). Pure."""
    token_ids = tensors.get("token_ids")
    stacked = tensors.get("hidden_states")
    n = len(item.input_ids)
    if token_ids is None or stacked is None:
        raise RefusedStates("truncated", f"sample {item.id}: the transfer holds {sorted(tensors)}")
    if token_ids.tolist() != list(item.input_ids):
        kind = "truncated" if token_ids.numel() < n else "mismatch"
        raise RefusedStates(kind, f"sample {item.id}: states for {token_ids.numel()} tokens that are not its {n}")
    if tuple(stacked.shape) != (n, num_aux + 1, hidden_size):
        expected = (n, num_aux + 1, hidden_size)
        raise RefusedStates("truncated", f"sample {item.id}: states {tuple(stacked.shape)}, expected {expected}")
    if not bool(torch.isfinite(stacked).all()):
        bad = int((~torch.isfinite(stacked)).sum())
        raise RefusedStates("nonfinite", f"sample {item.id}: {bad} states are NaN or infinite")
    return stacked


class Transfer(Protocol):
    """How the trainer reads a sample's states by the reply's kv_transfer_params."""

    def handle(self, params: dict[str, Any]) -> str | None: ...

    def get(self, params: dict[str, Any], timeout_s: float) -> dict[str, torch.Tensor]: ...

    def delete(self, handle: str) -> None: ...


class FileStates:
    """hs-connectors' FileTransfer: the file the reply names, then read-then-delete."""

    def __init__(self, directory: Path):
        from hs_connectors.transfer import FileTransfer

        self.transfer = FileTransfer(directory)

    def handle(self, params: dict[str, Any]) -> str | None:
        return params.get("hidden_states_path")

    def get(self, params: dict[str, Any], timeout_s: float) -> dict[str, torch.Tensor]:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                found = self.transfer.get_generated(params)
            except TimeoutError as exc:  # the connector still holds the file's lock
                raise TransferTimeout(str(exc)) from exc
            if found is not None:
                return found
            if time.monotonic() > deadline:
                raise TransferTimeout(f"{self.handle(params)} did not appear within {timeout_s:.0f} s")
            time.sleep(0.05)

    def delete(self, handle: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.transfer.delete(handle)
        Path(f"{handle}.lock").unlink(missing_ok=True)


class MooncakeStates:
    """hs-connectors' Mooncake store: the object the reply's manifest names, then removed."""

    def __init__(self, settings: MooncakeSettings, master: str, on_trouble: Callable[[], None]):
        from hs_connectors.mooncake_store import MooncakeHiddenStatesStore

        self.store = MooncakeHiddenStatesStore(store_config(settings, master))
        self.master = master
        self.on_trouble = on_trouble  # raises, naming the master, when it is gone
        try:
            self.store.setup()
        except Exception as exc:
            on_trouble()
            raise ServedStatesError(f"the trainer could not join the Mooncake store at {master}: {exc}") from exc

    def handle(self, params: dict[str, Any]) -> str | None:
        return params.get("handle")

    def get(self, params: dict[str, Any], timeout_s: float) -> dict[str, torch.Tensor]:
        from hs_connectors.mooncake_store import MooncakeIntegrityError

        try:
            return self.store.get_sample(params, timeout=timeout_s)
        except MooncakeIntegrityError as exc:  # the producer's error marker: NaN states, a failed put
            raise RefusedStates("producer_error", str(exc).splitlines()[0]) from exc
        except Exception as exc:
            self.on_trouble()  # a master that is gone is named, and ends the job
            if isinstance(exc, TimeoutError):
                raise TransferTimeout(f"{exc} (master {self.master})") from exc
            raise

    def delete(self, handle: str) -> None:
        self.store.delete_sample(handle)

    def close(self) -> None:
        """Leave the store (unmount this client's segment) while the master still answers: a
        client that outlives its master retries it for seconds on the way out. hs-connectors'
        store has no close of its own; its client is `_store` (tests/unit/test_private_apis.py)."""
        client = getattr(self.store, "_store", None)
        if client is not None:
            client.close()
            self.store._store = None


class ServedStates:
    """Training's source of states in served mode: the extraction server (launched here, or
    `endpoints`), the transfer, and the feed that asks ahead of the steps. `samples` before
    `expect` fetches at once (the eval split, at setup); after it, takes the next scheduled batch."""

    def __init__(self, verifier_dir: str, served: dict[str, Any], log_path: str, align: Callable[..., Sample] = shift):
        """`served` as train/launch.py passes it: the states' settings, hidden_states.served,
        the server section and the launcher's `backing` (train/served_servers.served_backing)."""
        states = served["states"]
        self.settings = settings_of(served)
        self.server = ServerConfig.from_section(served["server"])
        geometry = verifier_geometry(verifier_dir)
        self.aux_layer_ids = resolve_aux_layer_ids(states["aux_layer_ids"], geometry)
        self.hidden_size = geometry.hidden_size
        self.dtype = states["dtype"]
        self.store_dtype = torch_dtype(extraction_dtype(self.dtype))
        self.align = align
        self.stats = FeedStats()
        self.received: dict[str, int] = {}  # sample id -> times its states arrived and passed the checks
        self._master = backing_master(served)
        self._scheduled = False
        self._client: ChatClient | None = None
        self._stack = contextlib.ExitStack()
        try:
            self._open(served, verifier_dir, geometry.num_layers, states["trust_remote_code"], log_path)
        except BaseException:
            self._stack.close()
            raise

    def _open(self, served: dict[str, Any], verifier_dir: str, num_layers: int, trust: bool, log_path: str) -> None:
        s, backing = self.settings, served["backing"]
        self._urls, self._recovery = open_servers(
            self._stack, served, verifier_dir, self.aux_layer_ids, num_layers, trust, log_path
        )
        if s.transfer == "file":
            self.transfer: Transfer = FileStates(Path(backing["storage"]))
        else:
            master = s.mooncake.master or self._master.address  # type: ignore[union-attr]
            trainer = dataclasses.replace(s.mooncake, host=backing["host"])  # this node's address
            self.transfer = MooncakeStates(trainer, master, self._check_master)
            self._stack.callback(self.transfer.close)  # before the master and the server stop
        # Reads block (a lock, a poll, a copy): two threads beside the feed's loop.
        self._pool = self._stack.enter_context(ThreadPoolExecutor(2, thread_name_prefix="states-transfer"))
        self._feed = self._new_feed()
        self._stack.callback(self._feed.close)  # first: no request outlives the server
        log.info(
            "served hidden states: %s transfer from %s; aux layers %s, as %s; at most %.0f MB in flight",
            s.transfer,
            ", ".join(self._urls),
            self.aux_layer_ids,
            self.dtype,
            s.max_inflight_mb,
        )

    def _check_master(self) -> None:
        if self._master is not None:
            self._master.check()

    # --- what the trainer calls -------------------------------------------------------

    def expect(self, batches: Iterable[list[TokenSample]]) -> None:
        """The schedule from here on: this rank's batches in step order."""
        self._scheduled = True
        self._feed.expect(batches)

    def samples(self, items: list[TokenSample]) -> list[Sample]:
        if not self._scheduled:  # fetched now, as one batch (the eval split, at setup)
            self._feed.expect([items])
        return self._feed.take(items)

    def part(self) -> dict[str, Any]:
        """This process's share of the summary (`summary(parts)` merges the processes')."""
        return {"stats": self.stats.summary(), "received": dict(self.received)}

    def summary(self, parts: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """What the feeds did since this job started (the train log's and the stats row's):
        this process's, or every training process's `part` merged. Counts and rates add up;
        the peak bytes in flight and the waits are the largest one process had."""
        parts = parts or [self.part()]
        largest = ("peak_bytes_in_flight", "trainer_wait_s", "server_wait_s")
        stats: dict[str, Any] = {}
        for part in parts:
            for key, value in part["stats"].items():
                stats[key] = max(stats.get(key, 0), value) if key in largest else stats.get(key, 0) + value
        received: Counter[str] = Counter()
        for part in parts:
            received.update(part["received"])
        # How many samples arrived once, twice, ...: every epoch's samples exactly once each.
        times = Counter(received.values())
        return {
            "transfer": self.settings.transfer,
            "processes": len(parts),
            **stats,
            "samples_received_times": {str(k): times[k] for k in sorted(times)},
        }

    def close(self) -> None:
        log.info("served hidden states: %s", json.dumps(self.summary()))
        self._stack.close()

    # --- one sample ------------------------------------------------------------------------

    def _new_feed(self) -> StatesFeed:
        per_token = (len(self.aux_layer_ids) + 1) * self.hidden_size * 4  # float32, as training holds them
        return StatesFeed(
            self._fetch,
            lambda item: len(item.input_ids) * per_token,
            max_bytes=int(self.settings.max_inflight_mb * 2**20),
            concurrency=self.settings.concurrency,
            stats=self.stats,
            session=self._session,
        )

    @contextlib.asynccontextmanager
    async def _session(self) -> AsyncIterator[None]:
        client = ChatClient(
            self._urls,
            concurrency=self.settings.concurrency,
            request_timeout_s=self.settings.request_timeout_s,
            api_key_env=self.server.api_key_env,
            recovery=self._recovery,
        )
        async with client:
            self._client = client
            yield

    async def _fetch(self, item: TokenSample) -> Sample:
        assert self._client is not None
        loop = asyncio.get_running_loop()
        last = ""
        attempts = 1 + self.settings.retries
        for attempt in range(attempts):
            body = await self._client.completion(completion_request(item.input_ids, self.server.served_model_name))
            params = body.get("kv_transfer_params") or {}
            handle = self.transfer.handle(params)
            if handle is None:
                raise ServedStatesError(
                    f"sample {item.id}: the reply of {', '.join(self._urls)} carries no states handle "
                    f"(kv_transfer_params {params}): the server does not run the extract_hidden_states method "
                    f"with the {self.settings.transfer} connector"
                )
            try:
                tensors = await loop.run_in_executor(
                    self._pool, self.transfer.get, params, self.settings.transfer_timeout_s
                )
                stacked = check_states(item, tensors, len(self.aux_layer_ids), self.hidden_size)
            except (TransferTimeout, RefusedStates) as exc:
                self.stats.count(f"refused_{exc.kind}" if isinstance(exc, RefusedStates) else "transfer_timeouts")
                last = str(exc)
                log.warning("sample %s: %s; asking the server again (%d of %d)", item.id, exc, attempt + 1, attempts)
                continue
            finally:
                await loop.run_in_executor(self._pool, self._delete, item, handle)
            self.received[item.id] = self.received.get(item.id, 0) + 1
            return self._to_sample(item, stacked)
        raise ServedStatesError(f"sample {item.id}: no usable states after {attempts} requests; the last: {last}")

    def _delete(self, item: TokenSample, handle: str) -> None:
        """Read-then-delete: the states leave the transfer once read (or refused)."""
        try:
            self.transfer.delete(handle)
        except Exception as exc:  # the read's own error, if any, is the one to raise
            log.warning("sample %s: could not delete its states %s: %s", item.id, handle, exc)

    def _to_sample(self, item: TokenSample, stacked: torch.Tensor) -> Sample:
        """As offline training reads the sample back from the store: rounded to the storage
        dtype (hidden_states.dtype), then float32, in the draft method's alignment."""
        num_aux = len(self.aux_layer_ids)
        aux, final = split_states(stacked.to(self.store_dtype), num_aux)
        return self.align(
            torch.tensor(item.input_ids, dtype=torch.long),
            as_read_back(aux, num_aux, self.dtype),
            as_read_back(final, 1, self.dtype),
            torch.tensor(item.loss_mask, dtype=torch.bool),
        )
