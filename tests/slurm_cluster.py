"""The one-node SLURM cluster the SLURM tests submit to (tests/slurm/start_cluster.sh), and
the production profile changed only where that node cannot follow it."""

import copy
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from devkit.configs import merged
from tests.helpers import REPO, START_CLUSTER, START_CLUSTER_STDERR, run_start_cluster

PROFILE = REPO / "profiles/slurm/config.yaml"
SMALL = REPO / "tests/config/small.yaml"
# The test node's memory is shared by concurrent jobs; SLURM does not enforce it here
# (no cgroups), it only has to fit the node for scheduling.
TEST_MEM_MB = 2000
# Where tests/slurm/start_cluster.sh's slurmds write their process ids (one per node).
SLURMD_PIDFILES = "/run/slurmd-*.pid"
# The small config with a learning curve: one more variant, lc-50, on the shared run's data.
WITH_CURVE = {"learning_curve": {"fractions": [0.5]}}


def load_small() -> dict:
    """The small config with the learning curve, as a run sees it: merged over config/config.yaml."""
    small = merged(yaml.safe_load((REPO / "config/config.yaml").read_text()), yaml.safe_load(SMALL.read_text()))
    return merged(small, WITH_CURVE)


def real_profile() -> dict:
    return yaml.safe_load(PROFILE.read_text())


def cluster_env() -> dict[str, str]:
    """This environment without what a run started from inside a SLURM job would inherit."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("SNAKEMAKE", "SLURM_", "SBATCH_", "SRUN_"))}


def start_cluster() -> str:
    """Start (or find) the test cluster; return the partition to submit to."""
    if os.geteuid() == 0:
        proc = run_start_cluster()
        if proc.returncode != 0:
            pytest.fail(f"{START_CLUSTER} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        run_jobs_on_this_workers_cpus()
        return proc.stdout.split()[-1]
    if shutil.which("sinfo") is None:
        pytest.skip(f"not root and no SLURM installed: {START_CLUSTER} must run as root to install and start one")
    out = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True)
    defaults = [p.rstrip("*") for p in out.stdout.split() if p.endswith("*")]
    if out.returncode != 0 or not defaults:
        pytest.skip(f"not root, and the SLURM here does not answer with a default partition: {out.stderr.strip()}")
    return os.environ.get("EAGLEFLOW_SLURM_PARTITION", defaults[0])


def job_processes(job_id: str, marker: str) -> list[str]:
    """The processes alive on this node that belong to SLURM job `job_id`: found by their
    environment, which must hold both the job's id (SLURM sets it in everything the job starts)
    and the test's `marker` (NAME=VALUE, set in what the test submits), not by name
    (devkit.leftovers, .ci/run's check). One line each: pid and command."""
    from devkit.leftovers import leftovers

    return [f"{p.pid} {p.command}" for p in leftovers([f"SLURM_JOB_ID={job_id}", marker], None, set())]


def wait_until_no_process_of(job_id: str, marker: str, timeout_s: float = 30.0) -> list[str]:
    """Wait for every process of a cancelled job to end; returns those still alive after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while (alive := job_processes(job_id, marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return alive


def run_jobs_on_this_workers_cpus() -> None:
    """Every thread of the test cluster's slurmd takes the CPUs of this test worker
    (tests/conftest.py pins each worker to its own), and so every job it starts from now on.
    With TaskPlugin=task/none a job runs on slurmd's CPUs, which were those of whichever
    worker started the daemon: the SLURM runs of one worker then shared the other's CPU
    while their own idled (CI: test_slurm.py's run 372 s, 176 s on its own CPU; one of two CPUs idle
    for 9 minutes). The SLURM modules run on one worker (tests/conftest.py's SLURM_MODULES)."""
    cpus = os.sched_getaffinity(0)
    for pidfile in Path("/").glob(SLURMD_PIDFILES.lstrip("/")):
        pid = pidfile.read_text().strip()
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                os.sched_setaffinity(int(task.name), cpus)
            except ProcessLookupError:  # a thread that ended meanwhile
                continue


def node_cpus() -> int:
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%c"], capture_output=True, text=True, check=True)
    return min(int(c) for c in out.stdout.split())


def profile_for_test_cluster(real: dict, partition: str, cpus: int) -> dict:
    """The production profile, changed only where a one-node CPU test cluster cannot follow
    it: its partition, no account (accounting is off), no GPUs (the small config serves vLLM
    on CPU), CPUs (the run's too) and memory within the node, and status polls from 1 s on
    instead of 40 s."""
    profile = copy.deepcopy(real)
    defaults = profile["default-resources"]
    defaults["slurm_partition"] = partition
    del defaults["slurm_account"]
    defaults["mem_mb"] = min(defaults["mem_mb"], TEST_MEM_MB)
    profile["set-threads"] = {rule: min(n, cpus) for rule, n in profile["set-threads"].items()}
    for resources in profile["set-resources"].values():
        resources.pop("gpu", None)
        if "mem_mb" in resources:
            resources["mem_mb"] = min(resources["mem_mb"], TEST_MEM_MB)
    # A group of jobs asks for what its jobs hold at once, within `cores`: one node's worth.
    profile["cores"] = cpus
    profile["slurm-init-seconds-before-status-checks"] = 1
    profile["seconds-between-status-checks"] = 1
    return profile


def copy_for_cluster(finished_run: Path, module_tmp: Path) -> tuple[Path, Path, dict[str, str]]:
    """Start (or find) the test cluster; a copy of the finished run (tests.helpers.
    copy_finished_run) with the production profile made fit for the cluster in it, under
    `profiles/slurm-test`. Returns (the copy, the profile's folder, the environment to run
    Snakemake in)."""
    from devkit.runs import copy_finished_run

    partition = start_cluster()
    wf = module_tmp / "wf"
    copy_finished_run(finished_run, wf)
    profile_dir = wf / "profiles/slurm-test"
    profile_dir.mkdir(parents=True)
    profile = profile_for_test_cluster(real_profile(), partition, node_cpus())
    (profile_dir / "config.yaml").write_text(yaml.safe_dump(profile, sort_keys=False))
    return wf, profile_dir, cluster_env()


def two_node_partition(partition: str) -> str:
    """The test cluster's partition of two nodes beside `partition`; the test skips, quoting
    what start_cluster.sh said, where the cluster came up with one."""
    out = subprocess.run(["sinfo", "-h", "-o", "%P %D"], capture_output=True, text=True, check=True)
    sizes = {p.rstrip("*"): int(n) for p, n in (line.split() for line in out.stdout.splitlines())}
    two = f"{partition}-two"
    if sizes.get(two, 0) < 2:
        said = START_CLUSTER_STDERR.read_text()[-1500:] if START_CLUSTER_STDERR.exists() else ""
        pytest.skip(f"the test cluster has no two-node partition {two}: {sizes}; start_cluster.sh said:\n{said}")
    return two


def rules_on_two_nodes(profile_dir: Path, rules: list[str], nodelist: str | None = None) -> str:
    """Send the jobs of `rules` to the test cluster's two-node partition, to the node
    `nodelist` alone where given, in the profile at `profile_dir`. Returns the partition (the
    test skips where the cluster has none: two_node_partition)."""
    path = profile_dir / "config.yaml"
    profile = yaml.safe_load(path.read_text())
    two = two_node_partition(profile["default-resources"]["slurm_partition"])
    for rule in rules:
        resources = profile["set-resources"].setdefault(rule, {})
        resources["slurm_partition"] = two
        if nodelist:
            resources["slurm_extra"] = f"'--nodelist={nodelist}'"
    path.write_text(yaml.safe_dump(profile, sort_keys=False))
    return two
