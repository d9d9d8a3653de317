"""The files through which the jobs of one phase share a server (runtime.shared_server.SharedServer)
and its supervisor (runtime.supervise --shared) decides when nobody needs it any more.

One directory per shared server, `<run logs>/servers/shared-<key>/`:
- `lock`: flock held while a job looks up, launches or restarts the server, and while the
  supervisor stops it, so that no job attaches to a server that is going away;
- `server.json`: the running server (process group, port, log, who launched it);
- `consumers/<pid>-<start time>`: one file per job using it; a file whose process is gone
  (however it died) does not count;
- `exit-<pgid>.json`: how a server of this directory ended (read by jobs that did not start it).

Nothing here imports the launcher, so the supervisor stays a small process.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from eagleflow.common.atomic import write_json
from eagleflow.runtime.process import is_zombie, start_time

LEASE_NAME = "vllm-{pgid}.json"  # a launched server's lease, next to the shared directories


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
        """Record how the server of group `pgid` ended, and drop its lease (runtime.launch):
        its supervisor, the lease's owner, is about to exit having stopped the group."""
        write_json(self.path / f"exit-{pgid}.json", {"status": status})
        (self.path.parent / LEASE_NAME.format(pgid=pgid)).unlink(missing_ok=True)

    def read_exit(self, pgid: int) -> int | None:
        try:
            return json.loads((self.path / f"exit-{pgid}.json").read_text())["status"]
        except (FileNotFoundError, ValueError, KeyError):
            return None
