"""The one way a stage gets a server: an endpoint, its own launch, or the phase's shared one,
each with its recovery."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from eagleflow.runtime.endpoint_identity import Expected, check_endpoint, local_vllm_version
from eagleflow.runtime.recovery import Recovery, RestartDeadServer, RestartSharedServer, WaitForEndpoint
from eagleflow.runtime.shared_server import SharedServer, Sharing
from eagleflow.runtime.spec import Launchable, ServerConfig
from eagleflow.runtime.vllm_server import VllmServer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Served:
    """Where requests go (one URL, or several replicas), and what to do when the server
    behind them stops answering."""

    url: str | list[str]
    recovery: Recovery


@contextlib.contextmanager
def serve(
    spec: Launchable,
    log_path: str | os.PathLike,
    config: ServerConfig,
    endpoint: str | list[str] | None,
    sharing: Sharing | None = None,
) -> Iterator[Served]:
    """The running server(s) at `endpoint` (`server.endpoint`, or a stage's own), or a fresh
    server launched as `spec` says and stopped on exit, or with `sharing` the phase's shared
    one (launched by whichever job comes first); each with the recovery that the `server`
    section (`config`) asks for."""
    if endpoint:
        log.info("using the already running server(s) at %s", endpoint)
        expected = Expected(config.served_model_name, config.max_model_len, local_vllm_version())
        for url in [endpoint] if isinstance(endpoint, str) else endpoint:
            check_endpoint(url, expected, config.api_key_env, config.endpoint_wait_s)
        yield Served(endpoint, WaitForEndpoint(config.endpoint_wait_s))
        return
    with launched(spec, log_path, config.max_restarts, sharing) as served:
        yield served


@contextlib.contextmanager
def launched(
    spec: Launchable, log_path: str | os.PathLike, max_restarts: int, sharing: Sharing | None = None
) -> Iterator[Served]:
    """A server launched as `spec` says and stopped on exit, or with `sharing` the phase's
    shared one (launched by whichever job comes first), restarted up to `max_restarts` times."""
    if sharing is not None:
        with SharedServer(spec, sharing, Path(log_path).parent / "servers") as shared:
            yield Served(shared.base_url, RestartSharedServer(shared, max_restarts))
        return
    with VllmServer(spec, log_path) as server:
        yield Served(server.base_url, RestartDeadServer(server, max_restarts))
