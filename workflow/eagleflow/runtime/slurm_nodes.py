"""The nodes of the SLURM job this process runs in, and how to start a command on one of them
(`srun` as a step of the same job): served mode's extraction servers on nodes of their own
(train/served_servers.py, `hidden_states.served.placement: nodes`)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
from dataclasses import dataclass

# What a step started from inside another keeps of the environment: the job's identity. The
# rest (the step's node count, tasks, CPUs, GPUs) would be the defaults of the new step and
# conflict with its own flags (snakemake-executor-plugin-slurm-jobstep drops them likewise).
KEEP = ("SLURM_JOB_ID", "SLURM_JOBID", "SLURM_CLUSTER_NAME", "SLURM_SUBMIT_DIR", "SLURM_SUBMIT_HOST", "SLURM_CONF")


class PlacementError(RuntimeError):
    """The job's allocation cannot place what the config asks for."""


@dataclass(frozen=True)
class Node:
    name: str  # SLURM's node name
    address: str  # the IPv4 address other nodes reach it at (its NodeAddr, resolved)


@dataclass(frozen=True)
class Allocation:
    job_id: str
    this: Node  # where this process runs
    others: tuple[Node, ...]  # the job's other nodes, in SLURM's order


def _scontrol(*args: str) -> str:
    try:
        out = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise PlacementError(f"scontrol {' '.join(args)}: {exc}") from exc
    if out.returncode != 0:
        raise PlacementError(f"scontrol {' '.join(args)} failed: {out.stderr.strip()}")
    return out.stdout


def node_addresses(show_node: str) -> dict[str, str]:
    """{NodeName: NodeAddr} from `scontrol -o show node` output. Pure."""
    found = {}
    for line in show_node.splitlines():
        name, addr = re.search(r"NodeName=(\S+)", line), re.search(r"NodeAddr=(\S+)", line)
        if name and addr:
            found[name.group(1)] = addr.group(1)
    return found


def allocation(environ: dict[str, str] | None = None) -> Allocation:
    """This job's nodes, this one first. PlacementError outside a SLURM job."""
    env = os.environ if environ is None else environ
    job_id = env.get("SLURM_JOB_ID")
    if not job_id:
        raise PlacementError(
            "hidden_states.served.placement: nodes places the servers on nodes of the train job's SLURM "
            "allocation, and this job runs outside SLURM (no SLURM_JOB_ID): run it with the SLURM profile "
            "(profiles/slurm), or use placement: host"
        )
    # The job's nodes from slurmctld: inside a step (Snakemake's jobstep runs the rule with
    # `srun -n1`) SLURM_JOB_NODELIST is the step's one node.
    found = re.search(r"(?:^|\s)NodeList=(\S+)", _scontrol("-o", "show", "job", job_id))
    if found is None:
        raise PlacementError(f"scontrol show job {job_id} names no NodeList")
    names = _scontrol("show", "hostnames", found.group(1)).split()
    this = env.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    if this not in names:
        raise PlacementError(f"this node, {this}, is not among the job's nodes {names}")
    addresses = node_addresses(_scontrol("-o", "show", "node", ",".join(names)))

    def node(name: str) -> Node:
        addr = addresses.get(name, name)
        try:
            return Node(name, socket.gethostbyname(addr))
        except OSError as exc:
            raise PlacementError(f"node {name}: its address {addr} does not resolve: {exc}") from exc

    return Allocation(job_id, node(this), tuple(node(n) for n in names if n != this))


def srun_prefix(job_id: str, node: Node, name: str, environ: dict[str, str] | None = None) -> list[str]:
    """The argv before a command that runs it as one task of a new step of job `job_id` on
    `node`, sharing the job's resources there with its other steps (--overlap), ended with
    the job. The inherited step settings are unset first (KEEP)."""
    env = os.environ if environ is None else environ
    inherited = [var for var in sorted(env) if var.startswith(("SLURM_", "SRUN_")) and var not in KEEP]
    unset = [arg for var in inherited for arg in ("-u", var)]
    return [
        "env",
        *unset,
        "srun",
        f"--jobid={job_id}",
        "--nodes=1",
        "--ntasks=1",
        f"--nodelist={node.name}",
        "--overlap",
        "--kill-on-bad-exit=1",
        f"--job-name={name}",
    ]
