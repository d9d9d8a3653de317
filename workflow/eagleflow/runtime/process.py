"""Process groups: stop a whole group (a server and the workers it forked, torchrun and its
ranks), and turn SIGTERM into a clean exit so `with` blocks that stop such groups run.

Used by the launchers and the training stage's torchrun; run-only like all of runtime/, so
an edit restales nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)


def kill_group(pgid: int, grace_s: float) -> None:
    """SIGTERM a process group, wait up to `grace_s` for it to empty, then SIGKILL it."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not group_alive(pgid):
            return
        time.sleep(0.2)
    log.warning("process group %d ignored SIGTERM for %.0f s; sending SIGKILL", pgid, grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    # SIGKILL is delivered asynchronously: return only once the group is really gone.
    deadline = time.monotonic() + 10.0
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)


def group_alive(pgid: int) -> bool:
    """True while any process (not a zombie we could reap) is left in the group."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-pgid, os.WNOHANG)[0] > 0:
            pass
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    # killpg(0) also succeeds for zombies that our parent has not reaped yet.
    return bool(group_members(pgid))


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of group `pgid`."""
    return [pid for pid in _pids() if _pgid_of(pid) == pgid and not is_zombie(pid)]


def _pids() -> Iterator[int]:
    for name in os.listdir("/proc"):
        if name.isdigit():
            yield int(name)


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces; fields after ')' are fixed.
    return raw[raw.rfind(")") + 2 :].split()


def parent_pid(pid: int) -> int | None:
    """The parent of `pid`; None if there is no such process."""
    fields = _stat_fields(pid)
    return int(fields[1]) if fields else None


def start_time(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot); None if there is no such process. A pid
    together with its start time names one process even after the pid is reused."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else None


def first_on_pythonpath(directory: str) -> None:
    """Put `directory` first on this process's PYTHONPATH, which every job it starts inherits
    (rules/common.smk: the jobs import the package the DAG fingerprinted)."""
    parts = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if parts[0] != directory:
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [directory, *parts]))


def package_env(env: dict[str, str]) -> dict[str, str]:
    """`env` with the directory holding eagleflow first on PYTHONPATH: for the
    `python -m eagleflow...` processes a job starts (conda envs do not install it)."""
    parent = str(Path(__file__).resolve().parents[2])
    return env | {"PYTHONPATH": os.pathsep.join(filter(None, [parent, env.get("PYTHONPATH")]))}


def _pgid_of(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return int(fields[2]) if fields else None


def is_zombie(pid: int) -> bool:
    fields = _stat_fields(pid)
    return bool(fields) and fields[0] == "Z"


def terminate_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit so `with` blocks (and the server's group kill) run."""

    def _handler(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _handler)
