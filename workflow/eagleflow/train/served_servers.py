"""Served mode's extraction servers (train/served.py): how they are launched, where, and what
the train job starts beside them.

- `served_backing` (the train job's launcher, train/launch.py, once for all its training
  processes): the Mooncake master, unless `hidden_states.served.mooncake.master` names a
  running one, and the file transfer's directory; with `placement: nodes` the nodes of the
  job's SLURM allocation the servers go to. When training ends it stops the job's servers,
  then the master: nothing it started outlives the job.
- `open_servers` (each training process): `served.endpoints`, or `served.servers` launched
  replicas shared by the job's training processes (runtime.shared_server: the first process
  launches, the others attach, whichever sees one die restarts it), each with `server.gpus`
  GPUs of the job's (the last of them: the training processes keep the first), or with
  `placement: nodes` each on a node of its own: started there by
  `srun` as a step of the train job (runtime.slurm_nodes), bound to that node's address, its
  Mooncake client there too, so the states cross from its node to the trainer's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagleflow.common.config import typed
from eagleflow.common.fingerprint import runs_module
from eagleflow.hidden_states.vllm import extraction_server_args
from eagleflow.runtime.mooncake_master import MooncakeMaster, mooncake_master
from eagleflow.runtime.recovery import ByUrl, Recovery
from eagleflow.runtime.serving import launched, serve
from eagleflow.runtime.shared_server import Sharing, stop_idle_shared_servers
from eagleflow.runtime.slurm_nodes import Node, PlacementError, allocation, srun_prefix
from eagleflow.runtime.spec import ServerConfig, ServerSpec
from eagleflow.runtime.vllm_server import free_port

log = logging.getLogger(__name__)

# The Mooncake connector vLLM loads by module path, in the server's process.
MOONCAKE_CONNECTOR = "EagleflowMooncakeConnector"
MOONCAKE_CONNECTOR_MODULE = runs_module("eagleflow.hidden_states.mooncake_connector")
# A launched server waits this long for the next training process before it stops itself (the
# launcher stops it at once when training ends; this bounds a hard-killed job's).
LINGER_S = 30.0


@dataclass(frozen=True)
class MooncakeSettings:
    """`hidden_states.served.mooncake`."""

    master: str | None  # host:port of a running master; None: the train job starts one
    host: str  # this node's address in the store (and a started master's); placement nodes: SLURM's
    protocol: str  # tcp | rdma
    device: str  # RDMA device(s); "" lets Mooncake choose
    global_segment_mb: int  # memory each client (server, trainer) lends the store
    local_buffer_mb: int


@dataclass(frozen=True)
class ServedSettings:
    """`hidden_states.served`: how the states reach the trainer (none of it changes them)."""

    transfer: str  # file | mooncake
    endpoints: list[str] | None  # running extraction servers; None: the train job launches them
    servers: int  # launched replicas
    placement: str  # host | nodes
    storage_dir: str | None  # file transfer: where the server writes (default: system temp)
    max_inflight_mb: float
    concurrency: int
    request_timeout_s: float
    transfer_timeout_s: float
    retries: int
    mooncake: MooncakeSettings


def settings_of(served: dict[str, Any]) -> ServedSettings:
    return typed(ServedSettings, served["settings"], "hidden_states.served")


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


def sharing_name(log_path: str, i: int) -> str:
    """Server `i`'s name among the run's servers: the train job's log name and `served-<i>`
    (its log is `<logs>/train.<draft>.served-<i>.server.log`, and the load ledger counts it
    as the train stage's)."""
    return f"{Path(log_path).name.removesuffix('.log')}.served-{i}"


@contextlib.contextmanager
def served_backing(served: dict[str, Any], log_path: str) -> Iterator[dict[str, Any]]:
    """What the train job starts once for all its training processes: `served` with a
    `backing` entry (the master, the transfer's directory, the servers' nodes), for the
    training processes' ServedStates. Stops the launched servers and then the master on exit."""
    s = settings_of(served)
    placement = None
    host = s.mooncake.host
    if s.placement == "nodes" and not s.endpoints:
        if s.transfer != "mooncake":
            raise PlacementError("hidden_states.served.placement: nodes needs transfer: mooncake (file is one host's)")
        nodes = allocation()
        if len(nodes.others) < s.servers:
            raise PlacementError(
                f"hidden_states.served.placement: nodes puts each of the {s.servers} server(s) on a node of its own "
                f"beside the trainer's, and job {nodes.job_id} holds {1 + len(nodes.others)} node(s): the train "
                f"rule asks SLURM for 1 + servers (workflow/rules/train.smk; the profile passes it as --nodes)"
            )
        host = nodes.this.address
        placement = {"job_id": nodes.job_id, "nodes": [dataclasses.asdict(n) for n in nodes.others[: s.servers]]}
    storage = Path(s.storage_dir or tempfile.gettempdir()) / f"eagleflow-served-{os.getpid()}"
    lease_dir = Path(log_path).parent / "servers"
    with contextlib.ExitStack() as stack:
        devices = None
        if placement is None and not s.endpoints and served["server"]["gpus"] > 0:
            devices = split_gpus(s.servers, served["server"]["gpus"])
            stack.callback(os.environ.__setitem__, "CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES", ""))
            os.environ["CUDA_VISIBLE_DEVICES"] = devices["train"]
        master = None
        if s.transfer == "mooncake" and s.mooncake.master is None:
            master_log = Path(log_path).with_name(f"{Path(log_path).name}.mooncake-master")
            started = stack.enter_context(mooncake_master(host, master_log))
            master = dataclasses.asdict(started) | {"log_path": str(started.log_path)}
        if s.transfer == "file" and not s.endpoints:  # the launched servers' own files
            storage.mkdir(parents=True, exist_ok=True)
            stack.callback(shutil.rmtree, storage, True)
        # Training is over: its servers go first (before the master they put into).
        for i in range(s.servers):
            stack.callback(stop_idle_shared_servers, lease_dir, sharing_name(log_path, i))
        backing = {"host": host, "master": master, "storage": str(storage), "placement": placement, "gpus": devices}
        yield {**served, "backing": backing}


def split_gpus(servers: int, per_server: int, environ: dict[str, str] | None = None) -> dict[str, Any]:
    """The train job's GPUs (CUDA_VISIBLE_DEVICES: its claim, or SLURM's) split between the
    servers it launches on its host (the last `servers * per_server`, `per_server` each) and
    its training processes (the rest): {"servers": [csv, ...], "train": csv}."""
    env = os.environ if environ is None else environ
    visible = [d.strip() for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    need = servers * per_server
    if len(visible) < need:
        raise PlacementError(
            f"hidden_states.served: {servers} server(s) of server.gpus {per_server} take {need} GPUs of the train "
            f"job's host, and the job holds {len(visible)} ({env.get('CUDA_VISIBLE_DEVICES')!r}): the train rule "
            "asks for train.gpus + servers x server.gpus (its `gpu` resource); run it with a GPU profile"
        )
    rest = len(visible) - need
    chunks = [",".join(visible[rest + i * per_server : rest + (i + 1) * per_server]) for i in range(servers)]
    return {"servers": chunks, "train": ",".join(visible[:rest])}


def backing_master(served: dict[str, Any]) -> MooncakeMaster | None:
    """The master the launcher started (to name it when it is gone), or None."""
    master = served["backing"]["master"]
    return None if master is None else MooncakeMaster(**(master | {"log_path": Path(master["log_path"])}))


def open_servers(
    stack: contextlib.ExitStack,
    served: dict[str, Any],
    verifier_dir: str,
    aux_layer_ids: list[int],
    num_layers: int,
    trust_remote_code: bool,
    log_path: str,
) -> tuple[list[str], Recovery]:
    """The extraction servers' URLs and what to do when one stops answering; the launched
    servers are left (or stopped) when `stack` closes."""
    s, backing = settings_of(served), served["backing"]
    server = ServerConfig.from_section(served["server"])
    master = s.mooncake.master or (backing["master"] or {}).get("address")

    def spec_on(node: Node | None, i: int) -> ServerSpec:
        mooncake = None
        if s.transfer == "mooncake":
            own = dataclasses.replace(s.mooncake, host=node.address if node else backing["host"])
            mooncake = mooncake_transfer_config(own, master)
        storage = backing["storage"]
        spec = served_spec(server, verifier_dir, aux_layer_ids, num_layers, trust_remote_code, storage, mooncake)
        if node is None:
            gpus = backing["gpus"]
            env = {} if gpus is None else {"CUDA_VISIBLE_DEVICES": gpus["servers"][i]}  # the launcher's split
            return dataclasses.replace(spec, env={**spec.env, **env})
        # Its node's address, a port free on this node (the server's is the job's own too).
        wrapper = srun_prefix(backing["placement"]["job_id"], node, f"eagleflow-{sharing_name(log_path, i)}")
        return dataclasses.replace(spec, host=node.address, port=free_port(), wrapper=tuple(wrapper))

    if s.endpoints:
        found = stack.enter_context(serve(spec_on(None, 0), log_path, server, s.endpoints))
        return list(s.endpoints), found.recovery
    nodes = [Node(**n) for n in backing["placement"]["nodes"]] if backing["placement"] else [None] * s.servers
    recoveries: dict[str, Recovery] = {}
    for i, node in enumerate(nodes):
        sharing = Sharing(sharing_name(log_path, i), LINGER_S)  # GPUs: the launcher's split, or the node's
        found = stack.enter_context(launched(spec_on(node, i), log_path, server.max_restarts, sharing))
        assert isinstance(found.url, str)
        recoveries[found.url] = found.recovery
        where = f" on node {node.name}" if node else ""
        log.info("extraction server %d of %d at %s%s", i + 1, len(nodes), found.url, where)
    urls = list(recoveries)
    return urls, recoveries[urls[0]] if len(urls) == 1 else ByUrl(recoveries)
