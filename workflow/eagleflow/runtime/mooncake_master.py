"""A Mooncake master for the served mode's states (train/served.py), started by the job that
needs it and stopped with it: in its own process group under eagleflow's supervisor, so that
a killed job takes the master down too (runtime.supervise), and its whole group stopped on
every exit path.

`mooncake_master` ships with the `mooncake-transfer-engine` wheels (`-non-cuda` on CPUs). The
master keeps only metadata; the states live in the segments its clients (vLLM's connector,
the trainer) register. It binds its RPC port to `host` (127.0.0.1 unless the config says the
address other nodes reach), and answers GET /health on its metrics port.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx2 as httpx

from eagleflow.runtime.process import kill_group
from eagleflow.runtime.spec import ServerError
from eagleflow.runtime.vllm_server import free_port, tail

log = logging.getLogger(__name__)

STOP_GRACE_S = 10.0


class MooncakeMasterError(ServerError):
    """The Mooncake master did not start, or stopped answering."""


@dataclass(frozen=True)
class MooncakeMaster:
    """A running master: the address clients connect to, and where its health is asked."""

    address: str  # host:rpc_port
    health_url: str
    log_path: Path
    pgid: int

    def healthy(self) -> bool:
        try:
            return httpx.get(self.health_url, timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def check(self) -> None:
        """Raise MooncakeMasterError, naming the master, when it does not answer."""
        if not self.healthy():
            raise MooncakeMasterError(
                f"the Mooncake master at {self.address} does not answer {self.health_url}: it was stopped or "
                f"died; the states in flight are lost. Last lines of {self.log_path}:\n{tail(self.log_path)}"
            )


def master_binary() -> str:
    """mooncake_master of this environment (beside its python), else on PATH."""
    beside = Path(sys.executable).parent / "mooncake_master"
    found = str(beside) if beside.exists() else shutil.which("mooncake_master")
    if found is None:
        raise MooncakeMasterError(
            "mooncake_master is not installed: the served mode's Mooncake transfer needs the "
            "mooncake-transfer-engine wheel (`pip install -e '.[cpu]'` installs its -non-cuda build; "
            "Debian's libibverbs1 must be present for it to load)"
        )
    return found


@contextlib.contextmanager
def mooncake_master(
    host: str, log_path: str | os.PathLike, startup_timeout_s: float = 60.0
) -> Iterator[MooncakeMaster]:
    """A master on `host`, stopped (its whole process group) when the block ends."""
    rpc_port, health_port = free_port(host), free_port(host)
    cmd = [
        master_binary(),
        f"-rpc_address={host}",
        f"-rpc_port={rpc_port}",
        f"-metrics_port={health_port}",
        "-enable_http_metadata_server=false",
    ]
    supervised = [sys.executable, "-m", "eagleflow.runtime.supervise", "--parent", str(os.getpid())]
    supervised += ["--grace", str(STOP_GRACE_S), "--", *cmd]
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log.info("starting the Mooncake master on %s:%d (log: %s)", host, rpc_port, log_path)
    with open(log_path, "ab") as logfile:
        proc = subprocess.Popen(
            supervised, stdout=logfile, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    master = MooncakeMaster(f"{host}:{rpc_port}", f"http://{host}:{health_port}/health", log_path, proc.pid)
    try:
        deadline = time.monotonic() + startup_timeout_s
        while not master.healthy():
            if proc.poll() is not None:
                raise MooncakeMasterError(f"mooncake_master exited with {proc.returncode}:\n{tail(log_path)}")
            if time.monotonic() > deadline:
                raise MooncakeMasterError(f"mooncake_master did not answer within {startup_timeout_s:.0f} s")
            time.sleep(0.2)
        yield master
    finally:
        kill_group(proc.pid, STOP_GRACE_S)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
