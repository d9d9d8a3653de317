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
  master on `hidden_states.served.mooncake.host` unless `.master` names a running one. On a
  CPU the connector is hidden_states.mooncake_connector.

Each sample's states are checked before training sees them: the token ids the server
computed must be the sample's, the shape [tokens, aux + 1, hidden], every value finite. A
sample that fails, or whose states do not arrive within `transfer_timeout_s`, is counted,
logged with its id and asked for again (`retries` times), never trained on. A server that
dies is restarted by the launcher and the requests in flight are sent again (runtime.client).

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
import os
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from eagleflow.common.config import typed
from eagleflow.common.fingerprint import runs_module
from eagleflow.hidden_states.client import completion_request, split_states
from eagleflow.hidden_states.layers import resolve_aux_layer_ids, verifier_geometry
from eagleflow.hidden_states.storage import as_read_back, extraction_dtype, torch_dtype
from eagleflow.hidden_states.vllm import extraction_server_args
from eagleflow.runtime.client import ChatClient
from eagleflow.runtime.mooncake_master import MooncakeMaster, mooncake_master
from eagleflow.runtime.serving import serve
from eagleflow.runtime.spec import ServerConfig, ServerSpec
from eagleflow.train.data import Sample, shift
from eagleflow.train.feed import FeedStats, StatesFeed
from eagleflow.train.online import TokenSample

log = logging.getLogger(__name__)

# The Mooncake connector vLLM loads by module path, in the server's process.
MOONCAKE_CONNECTOR = "EagleflowMooncakeConnector"
MOONCAKE_CONNECTOR_MODULE = runs_module("eagleflow.hidden_states.mooncake_connector")


@dataclass(frozen=True)
class MooncakeSettings:
    """`hidden_states.served.mooncake`."""

    master: str | None  # host:port of a running master; None: the train job starts one
    host: str  # this node's address in the store (and a started master's)
    protocol: str  # tcp | rdma
    device: str  # RDMA device(s); "" lets Mooncake choose
    global_segment_mb: int  # memory each client (server, trainer) lends the store
    local_buffer_mb: int


@dataclass(frozen=True)
class ServedSettings:
    """`hidden_states.served`: how the states reach the trainer (none of it changes them)."""

    transfer: str  # file | mooncake
    endpoints: list[str] | None  # running extraction servers; None: the train job starts one
    storage_dir: str | None  # file transfer: where the server writes (default: system temp)
    max_inflight_mb: float
    concurrency: int
    request_timeout_s: float
    transfer_timeout_s: float
    retries: int
    mooncake: MooncakeSettings


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


def store_config(settings: MooncakeSettings, master: str) -> Any:
    """hs-connectors' MooncakeStoreConfig for one client of the store. Pure."""
    from hs_connectors.mooncake_store import MooncakeStoreConfig

    return MooncakeStoreConfig(
        local_hostname=settings.host,
        metadata_server="P2PHANDSHAKE",
        master_server_address=master,
        global_segment_size=settings.global_segment_mb << 20,
        local_buffer_size=settings.local_buffer_mb << 20,
        protocol=settings.protocol,
        device_name=settings.device,
    )


def mooncake_transfer_config(settings: MooncakeSettings, master: str) -> dict[str, Any]:
    """The server's --kv-transfer-config for the Mooncake transfer: the connector with this
    store's settings, the server's own address in it. Pure."""
    return {
        "kv_connector": MOONCAKE_CONNECTOR,
        "kv_connector_module_path": MOONCAKE_CONNECTOR_MODULE,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"mooncake": dataclasses.asdict(store_config(settings, master))},
    }


def served_spec(
    server: ServerConfig,
    verifier_dir: str,
    aux_layer_ids: list[int],
    num_layers: int,
    trust_remote_code: bool,
    storage: str,
    mooncake: dict[str, Any] | None,
) -> ServerSpec:
    """The extraction server, launched as the offline vllm backend launches it (the same
    speculative config and flags); with `mooncake` (a --kv-transfer-config) the states go
    into Mooncake's store instead of files under `storage`. Pure."""
    spec = ServerSpec.from_config(server, verifier_dir)
    trust = ["--trust-remote-code"] if trust_remote_code and "--trust-remote-code" not in spec.extra_args else []
    speculative_config, extra = extraction_server_args(aux_layer_ids, num_layers, storage)
    if mooncake is not None:
        flag = extra.index("--kv-transfer-config")
        extra = [*extra[: flag + 1], json.dumps(mooncake), *extra[flag + 2 :]]
    return dataclasses.replace(
        spec,
        speculative_config=speculative_config,
        extra_args=(*spec.extra_args, *trust, *extra),
        scratch_dirs=() if mooncake is not None else (storage,),
    )


class ServedStates:
    """Training's source of states in served mode: the extraction server (launched here, or
    `endpoints`), the transfer, and the feed that asks ahead of the steps. `samples` before
    `expect` fetches at once (the eval split, at setup); after it, takes the next scheduled batch."""

    def __init__(self, verifier_dir: str, served: dict[str, Any], log_path: str, align: Callable[..., Sample] = shift):
        states = served["states"]
        self.settings = typed(ServedSettings, served["settings"], "hidden_states.served")
        self.server = ServerConfig.from_section(served["server"])
        geometry = verifier_geometry(verifier_dir)
        self.aux_layer_ids = resolve_aux_layer_ids(states["aux_layer_ids"], geometry)
        self.hidden_size = geometry.hidden_size
        self.dtype = states["dtype"]
        self.store_dtype = torch_dtype(extraction_dtype(self.dtype))
        self.align = align
        self.stats = FeedStats()
        self.received: dict[str, int] = {}  # sample id -> times its states arrived and passed the checks
        self._master: MooncakeMaster | None = None
        self._scheduled = False
        self._client: ChatClient | None = None
        self._stack = contextlib.ExitStack()
        try:
            self._open(verifier_dir, geometry.num_layers, states["trust_remote_code"], log_path)
        except BaseException:
            self._stack.close()
            raise

    def _open(self, verifier_dir: str, num_layers: int, trust_remote_code: bool, log_path: str) -> None:
        s = self.settings
        mooncake, address = None, None
        if s.transfer == "mooncake":
            address = s.mooncake.master
            if address is None:
                master_log = Path(log_path).with_name(f"{Path(log_path).name}.mooncake-master")
                self._master = self._stack.enter_context(mooncake_master(s.mooncake.host, master_log))
                address = self._master.address
            mooncake = mooncake_transfer_config(s.mooncake, address)
        storage = Path(s.storage_dir or tempfile.gettempdir()) / f"eagleflow-served-{os.getpid()}"
        spec = served_spec(
            self.server, verifier_dir, self.aux_layer_ids, num_layers, trust_remote_code, str(storage), mooncake
        )
        if mooncake is None and not s.endpoints:  # the launched server's own files (its scratch dir)
            storage.mkdir(parents=True, exist_ok=True)
        served = self._stack.enter_context(serve(spec, log_path, self.server, s.endpoints))
        self._urls = [served.url] if isinstance(served.url, str) else list(served.url)
        self._recovery = served.recovery
        if mooncake is None:
            self.transfer: Transfer = FileStates(storage)
        else:
            self.transfer = MooncakeStates(s.mooncake, address, self._check_master)
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

    def summary(self) -> dict[str, Any]:
        """What the feeds did since this job started (the train log's and the stats row's)."""
        # How many samples arrived once, twice, ...: every epoch's samples exactly once each.
        times = Counter(self.received.values())
        received = {str(k): times[k] for k in sorted(times)}
        return {"transfer": self.settings.transfer, **self.stats.summary(), "samples_received_times": received}

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
