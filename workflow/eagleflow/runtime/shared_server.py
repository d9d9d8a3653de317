"""One server for every job of a phase (the parity jobs): the first job launches it, the
others attach, its supervisor (runtime.supervise --shared) stops it once no job has used it
for the linger time.

The jobs and the supervisor meet in one directory per shared server (SharedDir),
`<run logs>/servers/shared-<key>/`:
- `lock`: flock held while a job looks up, launches or restarts the server, and while the
  supervisor stops it, so that no job attaches to a server that is going away;
- `server.json`: the running server (process group, port, log, who launched it);
- `consumers/<pid>-<start time>`: one file per job using it; a file whose process is gone
  (however it died) does not count;
- `exit-<pgid>.json`: how a server of this directory ended (read by jobs that did not start it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2 as httpx

from eagleflow.common.atomic import write_json
from eagleflow.runtime.gpus import assign_job_gpus
from eagleflow.runtime.leases import LEASE_NAME
from eagleflow.runtime.process import group_alive, is_zombie, kill_group, start_time
from eagleflow.runtime.spec import Launchable, ServerError, spec_key
from eagleflow.runtime.vllm_server import VllmServer, describe_exit, tail

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sharing:
    """How the jobs of a phase share one server: `name` the phase (its log is
    `<log dir>/<name>.server.log`), `linger_s` how long the server waits for the next job,
    `gpus` how many the server takes (claimed by the job that launches it)."""

    name: str
    linger_s: float
    gpus: int = 0


class SharedServer:
    """One server for every job of a phase. The first job launches it; later jobs (and jobs
    running at the same time) attach to it; it stops once no job has used it for
    `sharing.linger_s` (or when `stop_idle_shared_servers` ends the phase). Jobs whose spec
    differs (another model, other layers, other flags) get their own. Use as a context
    manager: entering registers this job and waits until the server is healthy (a server
    still loading is waited for up to its startup timeout, counted from its launch)."""

    def __init__(self, spec: Launchable, sharing: Sharing, lease_dir: str | os.PathLike):
        self.spec = spec
        self.sharing = sharing
        self.lease_dir = Path(lease_dir)
        self.log_path = self.lease_dir.parent / f"{sharing.name}.server.log"
        # Per host: the jobs of one submission (or one machine) share it; the launch binds loopback.
        self.dir = SharedDir(self.lease_dir / f"shared-{sharing.name}-{spec_key(spec)}-{socket.gethostname()}")
        self.state: dict[str, Any] = {}
        self._consumer: Path | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.spec.host}:{self.state['port']}"

    def __enter__(self) -> SharedServer:
        self._consumer = self.dir.register(os.getpid(), " ".join(sys.argv)[:500])
        try:
            with self.dir.locked():
                state = self.dir.live_state()
                if state is None:
                    self.state = self._launch(port=None, kind="start")
                else:
                    self.state = state
                    log.info(
                        "using the phase's shared %s on %s: started by pid %d (%s); log %s",
                        self.spec.name,
                        self.base_url,
                        state["launched_by_pid"],
                        state["launched_by"],
                        state["log"],
                    )
            self.wait_healthy()
        except BaseException:
            self._leave()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._leave()

    def _leave(self) -> None:
        if self._consumer is not None:
            self._consumer.unlink(missing_ok=True)
            self._consumer = None

    def _launch(self, port: int | None, kind: str) -> dict[str, Any]:
        """Launch the server for the phase (the caller holds the lock)."""
        claim = assign_job_gpus(self.sharing.gpus)
        try:
            # A spec's own port (a server on another node) unless restarted on the one it had.
            spec = dataclasses.replace(self.spec, port=port or self.spec.port)
            server = VllmServer(spec, self.log_path, self.lease_dir)
            server.launch(
                shared=self.dir, linger_s=self.sharing.linger_s, pass_fds=claim.fds() if claim else (), kind=kind
            )
        finally:
            if claim is not None:
                claim.release()  # the supervisor holds the same locks for the server's life
        assert server.proc is not None
        state = {
            "pgid": server.proc.pid,
            "leader_started": start_time(server.proc.pid) or 0,
            "port": server.port,
            "model": self.spec.model,
            "log": str(self.log_path),
            "started_at": time.time(),
            "launched_by_pid": os.getpid(),
            "launched_by": " ".join(sys.argv)[:500],
            "stop_grace_s": self.spec.stop_grace_s,
        }
        self.dir.write_state(state)
        did = "started" if kind == "start" else "restarted"
        log.info("this job %s the phase's shared %s; later jobs attach to it", did, self.spec.name)
        return state

    def alive(self) -> bool:
        return process_alive(self.state["pgid"], self.state["leader_started"])

    def describe_end(self) -> str:
        status = self.dir.read_exit(self.state["pgid"])
        return describe_exit(status) if status is not None else "ended"

    def wait_healthy(self) -> None:
        deadline = self.state["started_at"] + self.spec.startup_timeout_s
        started = time.monotonic()
        with httpx.Client(timeout=5.0) as client:
            while True:
                if not self.alive():
                    raise ServerError(
                        f"the shared {self.spec.name} ({self.spec.model}) {self.describe_end()} before becoming "
                        f"healthy. Last lines of {self.log_path}:\n{tail(self.log_path)}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{self.base_url}/health").status_code == 200:
                        log.info("%s healthy (waited %.0f s)", self.spec.name, time.monotonic() - started)
                        return
                if time.time() > deadline:
                    if self.state["launched_by_pid"] == os.getpid():
                        self.dir.clear_state(self.state["pgid"])
                        stop_shared(self.dir, self.state)
                    raise ServerError(
                        f"the shared {self.spec.name} did not answer {self.base_url}/health within "
                        f"{self.spec.startup_timeout_s:.0f} s of its start (server.startup_timeout_s). "
                        f"Last lines of {self.log_path}:\n{tail(self.log_path)}"
                    )
                time.sleep(1.0)

    def restart(self, seen_pgid: int) -> None:
        """Start the server again on its port, unless another job already did since this one
        saw group `seen_pgid` fail; then wait until it is healthy."""
        with self.dir.locked():
            state = self.dir.live_state()
            if state is not None and state["pgid"] != seen_pgid:
                self.state = state
            else:
                if state is not None:  # alive, but its engine is not: stop what is left of it
                    stop_shared(self.dir, state)
                self.state = self._launch(port=self.state["port"], kind="restart")
        self.wait_healthy()


def stop_idle_shared_servers(lease_dir: str | os.PathLike, name: str) -> int:
    """Stop the shared servers of phase `name` that no job uses (the phase is over: the
    GPUs are free for the next one at once, not after the linger time). Returns how many."""
    stopped = 0
    for path in sorted(Path(lease_dir).glob(f"shared-{name}-*")):
        shared = SharedDir(path)
        with shared.locked():
            state = shared.live_state()
            if state is None or shared.live_consumers():
                continue
            log.info("stopping the shared server of %s (process group %d): the phase is over", name, state["pgid"])
            shared.clear_state(state["pgid"])
            stop_shared(shared, state)
            stopped += 1
    return stopped


def stop_shared(shared: SharedDir, state: dict[str, Any]) -> None:
    """Stop a shared server: ask its supervisor (SIGTERM), which stops the group and drops
    the lease; SIGKILL the group only if that has not happened after the grace period."""
    pgid, grace = state["pgid"], state["stop_grace_s"]
    with contextlib.suppress(ProcessLookupError):
        os.kill(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace + 10
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if group_alive(pgid):
        kill_group(pgid, 0)
        (shared.path.parent / LEASE_NAME.format(pgid=pgid)).unlink(missing_ok=True)


def process_alive(pid: int, started: int) -> bool:
    """Whether process `pid` that started at `started` (clock ticks) still runs (an exited
    child its launcher has not reaped yet does not)."""
    return start_time(pid) == started and not is_zombie(pid)


class SharedDir:
    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.state = self.path / "server.json"
        self.consumers = self.path / "consumers"

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        self.consumers.mkdir(parents=True, exist_ok=True)
        with open(self.path / "lock", "a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    @staticmethod
    def consumer_name(pid: int) -> str:
        return f"{pid}-{start_time(pid)}"

    def register(self, pid: int, job: str) -> Path:
        self.consumers.mkdir(parents=True, exist_ok=True)
        path = self.consumers / self.consumer_name(pid)
        path.write_text(job)
        return path

    def live_consumers(self) -> list[str]:
        """Names of the registered jobs that still run; the files of dead ones are removed."""
        live = []
        for path in sorted(self.consumers.glob("*-*")) if self.consumers.is_dir() else []:
            pid, _, started = path.name.partition("-")
            if pid.isdigit() and started.isdigit() and process_alive(int(pid), int(started)):
                live.append(path.name)
            else:
                path.unlink(missing_ok=True)
        return live

    def read_state(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.state.read_text())
        except FileNotFoundError:
            return None

    def live_state(self) -> dict[str, Any] | None:
        """server.json if its supervisor still runs, else None."""
        state = self.read_state()
        if state and process_alive(state["pgid"], state["leader_started"]):
            return state
        return None

    def write_state(self, state: dict[str, Any]) -> None:
        write_json(self.state, state)

    def clear_state(self, pgid: int) -> None:
        """Forget the server of group `pgid` (not a newer one started in its place)."""
        state = self.read_state()
        if state and state["pgid"] == pgid:
            self.state.unlink(missing_ok=True)

    def write_exit(self, pgid: int, status: int) -> None:
        """Record how the server of group `pgid` ended, and drop its lease (runtime.vllm_server):
        its supervisor, the lease's owner, is about to exit having stopped the group."""
        write_json(self.path / f"exit-{pgid}.json", {"status": status})
        (self.path.parent / LEASE_NAME.format(pgid=pgid)).unlink(missing_ok=True)

    def read_exit(self, pgid: int) -> int | None:
        try:
            return json.loads((self.path / f"exit-{pgid}.json").read_text())["status"]
        except (FileNotFoundError, ValueError, KeyError):
            return None
