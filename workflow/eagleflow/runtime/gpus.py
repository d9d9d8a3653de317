"""Disjoint GPUs for jobs that run at the same time on one host.

Core Snakemake counts a `gpu` resource (`--resources gpu=N`) but never says *which* devices
a job may use, so two jobs that each take one GPU would both land on device 0. A job that
declares `resources: gpu=n` claims n devices here before it touches CUDA: one lock file per
device in a per-host directory, held with `flock` for the life of the process (the kernel
drops it when the process dies, however it dies). The claimed devices become the job's
`CUDA_VISIBLE_DEVICES`. Snakemake's resource accounting guarantees that enough devices are
free; the short wait only covers a finished job whose process is still exiting.

Under SLURM the scheduler sets `CUDA_VISIBLE_DEVICES` itself, and this does nothing.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)


def device_pool(environ: dict[str, str] | None = None, dev_dir: str = "/dev") -> list[str]:
    """The devices this host lets jobs use: CUDA_VISIBLE_DEVICES as set when Snakemake was
    started (a user's restriction), else every /dev/nvidiaN. Read without importing torch:
    CUDA_VISIBLE_DEVICES only takes effect if it is set before CUDA initialises."""
    environ = os.environ if environ is None else environ
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip() and d.strip() != "-1"]
    names = [p.name[len("nvidia") :] for p in Path(dev_dir).glob("nvidia[0-9]*")]
    return sorted((n for n in names if n.isdigit()), key=int)


def default_lock_dir() -> Path:
    return Path(os.environ.get("EAGLEFLOW_GPU_LOCK_DIR") or f"/tmp/eagleflow-gpus-{os.getuid()}")


@dataclass
class GpuClaim:
    devices: list[str]
    _fds: list[int] = field(default_factory=list, repr=False)

    def fds(self) -> tuple[int, ...]:
        """The locked descriptors, for a process that keeps the devices after this one exits."""
        return tuple(self._fds)

    def release(self) -> None:
        for fd in self._fds:
            os.close(fd)  # closing the descriptor drops the flock
        self._fds.clear()


def claim_gpus(count: int, pool: list[str], lock_dir: Path, timeout_s: float = 60.0, poll_s: float = 0.2) -> GpuClaim:
    """Lock `count` devices of `pool` for this process (non-blocking tries, polled until
    `timeout_s`). Raises RuntimeError naming the pool and the lock dir when it cannot."""
    if count > len(pool):
        raise RuntimeError(
            f"the job needs {count} GPUs but this host offers {len(pool)} ({','.join(pool) or 'none'}); "
            "lower the job's gpu count in config or run it where there are more devices"
        )
    lock_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout_s
    while True:
        claim = GpuClaim(devices=[])
        for device in pool:
            fd = os.open(lock_dir / f"gpu-{device}.lock", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            claim.devices.append(device)
            claim._fds.append(fd)
            if len(claim.devices) == count:
                return claim
        claim.release()
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"could not lock {count} of the GPUs {','.join(pool)} within {timeout_s:.0f} s (locks in {lock_dir}); "
                "another job or another Snakemake run on this host holds them. Give Snakemake --resources gpu=N "
                "with N no larger than the number of devices"
            )
        time.sleep(poll_s)


def assign_job_gpus(count: int, environ: dict[str, str] | None = None) -> GpuClaim | None:
    """Set CUDA_VISIBLE_DEVICES for a job that takes `count` GPUs, unless a scheduler already
    did (SLURM) or the job takes none. Returns the claim; keep it alive for the job's life."""
    environ = os.environ if environ is None else environ
    if count <= 0 or "SLURM_JOB_ID" in environ:
        return None
    pool = device_pool(environ)
    claim = claim_gpus(count, pool, default_lock_dir())
    environ["CUDA_VISIBLE_DEVICES"] = ",".join(claim.devices)
    log.info("GPUs %s of %s assigned to this job", ",".join(claim.devices), ",".join(pool))
    return claim


def describe_gpu_holders(gpus_csv: str, apps_csv: str, visible: str | None) -> list[str]:
    """Processes on the GPUs this job may use, one line each. Pure.

    `gpus_csv`: `nvidia-smi --query-gpu=index,uuid --format=csv,noheader`;
    `apps_csv`: `nvidia-smi --query-compute-apps=gpu_uuid,pid,process_name,used_memory
    --format=csv,noheader`; `visible`: CUDA_VISIBLE_DEVICES (indices or UUIDs; None: all)."""
    index_of = {}
    for line in gpus_csv.strip().splitlines():
        index, uuid = (x.strip() for x in line.split(",", 1))
        index_of[uuid] = index
    wanted = None if visible is None else {v.strip() for v in visible.split(",") if v.strip()}
    lines = []
    for line in apps_csv.strip().splitlines():
        uuid, pid, name, memory = (x.strip() for x in line.split(",", 3))
        index = index_of.get(uuid, "?")
        if wanted is None or index in wanted or uuid in wanted:
            lines.append(f"GPU {index}: pid {pid} ({name}) holds {memory}")
    return lines


def gpu_holders() -> list[str]:
    """describe_gpu_holders for this host and job; empty without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        query = ["nvidia-smi", "--format=csv,noheader"]
        gpus = subprocess.run([*query, "--query-gpu=index,uuid"], capture_output=True, text=True, timeout=30)
        apps = subprocess.run(
            [*query, "--query-compute-apps=gpu_uuid,pid,process_name,used_memory"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return [f"(nvidia-smi failed: {e})"]
    return describe_gpu_holders(gpus.stdout, apps.stdout, os.environ.get("CUDA_VISIBLE_DEVICES"))
