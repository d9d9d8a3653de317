"""Leases: which job launched which server, so that a later job stops the servers of a dead
one (`<log dir>/servers/vllm-<pgid>.json`)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from eagleflow.runtime.process import group_members, kill_group, start_time

log = logging.getLogger(__name__)

LEASE_NAME = "vllm-{pgid}.json"  # a launched server's lease, next to the shared servers' directories


@dataclass(frozen=True)
class Lease:
    """Who launched a server, and how to find what is left of it."""

    pgid: int  # the supervisor's pid: the server's process group
    leader_started: int  # the supervisor's start time (a reused pid is another process)
    owner_pid: int  # the job process that launched it
    owner_started: int
    port: int
    model: str
    job: str  # the owning job's command line, for the log line that names it
    log: str

    @staticmethod
    def path(lease_dir: Path, pgid: int) -> Path:
        return lease_dir / LEASE_NAME.format(pgid=pgid)


def stop_leftover_servers(lease_dir: Path, grace_s: float) -> list[Lease]:
    """Stop every server under `lease_dir` whose owning job is gone; return their leases.

    A lease whose owner is alive belongs to a running job and is left alone. One whose group
    leader was replaced by an unrelated process (pid reuse) is only removed."""
    stopped = []
    for path in sorted(lease_dir.glob("vllm-*.json")):
        try:
            lease = Lease(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError) as e:
            log.warning("removing unreadable server lease %s (%s)", path, e)
            path.unlink(missing_ok=True)
            continue
        if start_time(lease.owner_pid) == lease.owner_started:
            continue
        leader = start_time(lease.pgid)
        members = group_members(lease.pgid) if leader in (None, lease.leader_started) else []
        if members:
            log.warning(
                "stopping a vLLM server left behind by a dead job: process group %d (%d processes), port %d, "
                "model %s, launched by pid %d (%s); log %s; lease %s",
                lease.pgid,
                len(members),
                lease.port,
                lease.model,
                lease.owner_pid,
                lease.job,
                lease.log,
                path,
            )
            kill_group(lease.pgid, grace_s)
            stopped.append(lease)
        path.unlink(missing_ok=True)
    return stopped
