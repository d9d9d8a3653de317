"""Launch one server in its own process group under a supervisor (runtime.supervise), wait
for its health, stop the whole group. Every launch is a lease (runtime.leases) and a line of
the load ledger (runtime.ledger)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import httpx2 as httpx

from eagleflow.common.atomic import write_json
from eagleflow.runtime.gpus import gpu_holders
from eagleflow.runtime.leases import Lease, stop_leftover_servers
from eagleflow.runtime.ledger import record_load
from eagleflow.runtime.process import kill_group, package_env, start_time
from eagleflow.runtime.spec import Launchable, ServerError

if TYPE_CHECKING:  # the shared server imports this module to launch its server
    from eagleflow.runtime.shared_server import SharedDir

log = logging.getLogger(__name__)


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
    """A running vLLM server. Use as a context manager: the process group dies on exit.

    `lease_dir` (default: `servers/` next to the log) holds the leases of a run's servers."""

    def __init__(self, spec: Launchable, log_path: str | os.PathLike, lease_dir: str | os.PathLike | None = None):
        self.spec = spec
        self.log_path = Path(log_path)
        self.lease_dir = Path(lease_dir) if lease_dir else self.log_path.parent / "servers"
        self.port = spec.port or free_port(spec.host)
        self.proc: subprocess.Popen | None = None
        self.gpu_holders: list[str] = []

    @property
    def base_url(self) -> str:
        return f"http://{self.spec.host}:{self.port}"

    def start(self) -> None:
        self.launch()
        self.wait_healthy()

    def launch(
        self, shared: SharedDir | None = None, linger_s: float = 0.0, pass_fds: Sequence[int] = (), kind: str = "start"
    ) -> None:
        """Start the process group (not waiting for health). Call it from a thread that
        outlives the server: Linux sends the parent-death signal when the *thread* that
        started a process exits, so a server launched from a pool's worker thread would be
        stopped by its supervisor when that thread retires.

        With `shared`, the server outlives this job: its supervisor follows the consumers
        registered there, and `pass_fds` (this job's GPU locks) stay held by it."""
        self.spec.check()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.lease_dir.mkdir(parents=True, exist_ok=True)
        stop_leftover_servers(self.lease_dir, self.spec.stop_grace_s)
        self.gpu_holders = gpu_holders()
        if self.gpu_holders:
            log.warning("the GPUs of this job are in use before vLLM starts:\n  %s", "\n  ".join(self.gpu_holders))
        cmd = self.spec.command(self.port)
        owner = ["--shared", str(shared.path), "--linger", str(linger_s)] if shared else ["--parent", str(os.getpid())]
        supervised = [
            sys.executable,
            "-m",
            "eagleflow.runtime.supervise",
            *owner,
            "--grace",
            str(self.spec.stop_grace_s),
            *(arg for path in self.spec.scratch_dirs for arg in ("--scratch", path)),
            "--",
            *cmd,
        ]
        env = package_env({**os.environ, **{k: str(v) for k, v in self.spec.env.items()}})
        log.info("starting %s on %s (log: %s): %s", self.spec.name, self.base_url, self.log_path, " ".join(cmd))
        with open(self.log_path, "ab") as logfile:
            self.proc = subprocess.Popen(
                supervised,
                stdout=logfile,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
                pass_fds=tuple(pass_fds),
            )
        self._write_lease(shared is not None)
        record_load(self.lease_dir, self.log_path, self.spec.model, kind, shared is not None)

    def _write_lease(self, shared: bool) -> None:
        assert self.proc is not None
        # A shared server's owner is its own supervisor: it outlives the job that launched it.
        owner = self.proc.pid if shared else os.getpid()
        lease = Lease(
            pgid=self.proc.pid,
            leader_started=start_time(self.proc.pid) or 0,
            owner_pid=owner,
            owner_started=start_time(owner) or 0,
            port=self.port,
            model=self.spec.model,
            job=" ".join(sys.argv)[:500],
            log=str(self.log_path),
        )
        write_json(Lease.path(self.lease_dir, lease.pgid), dataclasses.asdict(lease))

    def _failure(self, what: str) -> ServerError:
        held = (
            "\nProcesses holding this job's GPUs before the start (not vLLM's own memory):\n  "
            + "\n  ".join(self.gpu_holders)
            if self.gpu_holders
            else ""
        )
        return ServerError(f"{what}. Last lines of {self.log_path}:\n{tail(self.log_path)}{held}")

    def wait_healthy(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.spec.startup_timeout_s
        started = time.monotonic()
        with httpx.Client(timeout=5.0) as client:
            while True:
                code = self.proc.poll()
                if code is not None:
                    raise self._failure(
                        f"{self.spec.name} exited with code {code} before becoming healthy (model {self.spec.model})"
                    )
                try:
                    if client.get(f"{self.base_url}/health").status_code == 200:
                        log.info("%s healthy after %.0f s", self.spec.name, time.monotonic() - started)
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise self._failure(
                        f"{self.spec.name} did not answer {self.base_url}/health within "
                        f"{self.spec.startup_timeout_s:.0f} s (server.startup_timeout_s)"
                    )
                time.sleep(1.0)

    def stop(self) -> None:
        """Stop the whole process group: SIGTERM, then SIGKILL after `spec.stop_grace_s`."""
        if self.proc is None:
            return
        kill_group(self.proc.pid, self.spec.stop_grace_s)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        Lease.path(self.lease_dir, self.proc.pid).unlink(missing_ok=True)
        self.proc = None

    def exit_status(self) -> int | None:
        """The launched server's exit status (the supervisor's: vLLM's, 128 + n after signal
        n), or None while it runs."""
        return self.proc.poll() if self.proc is not None else None

    def __enter__(self) -> VllmServer:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
        # Its clients are done with it: what they did not read goes (a restart, by contrast,
        # keeps what the server wrote before it died for the clients to read).
        for path in self.spec.scratch_dirs:
            shutil.rmtree(path, ignore_errors=True)


def describe_exit(status: int) -> str:
    if status > 128 and status - 128 in signal.Signals._value2member_map_:
        return f"killed by {signal.Signals(status - 128).name}"
    return f"exit status {status}"
