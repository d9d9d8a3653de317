"""What the slow integration tests share: the finished run (one DAG run with a real vLLM), and a
copy of it with the vllm hidden-state backend's store."""

import fcntl
import json
import os
import shutil
import signal
import subprocess
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest

from devkit.runs import copy_finished_run, copy_workflow
from eagleflow.runtime.process import group_members, parent_pid
from eagleflow.runtime.spec import ServerSpec
from tests.helpers import REPO, SNAKEMAKE, run_start_cluster, stored_replies, vllm_available
from tests.vllm_store import build_vllm_store


@pytest.fixture(scope="session", autouse=True)
def slurm_controller_up_or_no_slurm():
    """Every `snakemake` start loads the SLURM executor plugin, which asks the controller for
    its config (`scontrol show config`) and waits 10 s for an answer when SLURM's client is
    installed but no controller runs: on a machine where an earlier session installed the test
    cluster, that is 10 s per Snakemake call, about a hundred calls here. Start the cluster
    (tests/slurm/start_cluster.sh, idempotent) before the first one, as the SLURM test would."""
    if (
        shutil.which("scontrol") is None
        or subprocess.run(["pgrep", "-x", "slurmctld"], capture_output=True).returncode == 0
    ):
        return
    if os.geteuid() != 0:
        warnings.warn(
            "SLURM is installed but its controller is down: every snakemake call waits 10 s for it", stacklevel=1
        )
        return
    proc = run_start_cluster()
    if proc.returncode != 0:
        warnings.warn(
            f"tests/slurm/start_cluster.sh failed, snakemake calls wait 10 s each: {proc.stderr[-1000:]}", stacklevel=1
        )


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory, worker_id):
    """The run every test here reads. It starts with a hard kill: `kill -9` of Snakemake's
    whole process group mid-generate (an OOM kill, a crashed terminal); what the kill left is
    in `hard_kill.json`. Then `--unlock` and the same command, as docs/operations.md says;
    during that rerun, generate's vLLM is SIGKILLed once (`server_kill.json`).

    Built once per pytest session (built_once). Tests use it in place only in
    tests/conftest.py's IN_PLACE_MODULES (one worker); elsewhere they take a copy
    (tests.helpers.copy_finished_run)."""
    if not vllm_available():
        pytest.skip("vLLM is not installed")
    return built_once(tmp_path_factory, worker_id, "finished-run", build_finished_run)


@pytest.fixture(scope="session")
def vllm_store(finished_run, tmp_path_factory, worker_id):
    """A copy of the finished run with the vllm backend's store, built through a server kill
    and a job kill, and the draft trained on it (tests/vllm_store.py). Built once per pytest
    session, as finished_run is; read in place, never changed."""
    return built_once(tmp_path_factory, worker_id, "vllm-store", lambda wf: build_vllm_store(finished_run, wf))


def built_once(tmp_path_factory, worker_id: str, name: str, build: Callable[[Path], str | None]) -> Path:
    """`build(wf)` once per pytest session: under pytest-xdist the first worker to ask runs it
    in the session's shared temporary directory while the others wait on a lock, and a failed
    build (its message, or what it raised) fails every worker's tests with its message."""
    base = tmp_path_factory.getbasetemp()
    home = (base if worker_id == "master" else base.parent) / name
    home.mkdir(exist_ok=True)
    wf, done, failed = home / "wf", home / "done", home / "failed.txt"
    with open(home / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists() and not failed.exists():
            try:
                error = build(wf)
            except Exception:
                error = traceback.format_exc()
            (failed if error else done).write_text(error or "")
    if failed.exists():
        pytest.fail(failed.read_text())
    return wf


def build_finished_run(wf: Path) -> str | None:
    """Run the small DAG into `wf` as finished_run says; the failure's message, or None."""
    if reuse := os.environ.get("EAGLEFLOW_FINISHED_RUN"):
        # While working on a module that builds on the run: a copy of an earlier one (its
        # `wf` directory), with this checkout's code; what the code changed reruns.
        copy_finished_run(Path(reuse), wf)
        return None
    copy_workflow(wf)
    cmd = SNAKEMAKE + ["--cores", "2", "--configfile", str(REPO / "tests/config/small.yaml")]
    (wf / "hard_kill.json").write_text(json.dumps(hard_kill_mid_generate(wf, cmd)))
    subprocess.run([*cmd, "--unlock"], cwd=wf, capture_output=True, check=True)
    with open(wf / "rerun.out", "w") as out, open(wf / "rerun.err", "w") as err:
        rerun = subprocess.Popen(cmd, cwd=wf, stdout=out, stderr=err, text=True)
        (wf / "server_kill.json").write_text(json.dumps(sigkill_vllm_mid_generate(wf, rerun)))
        rerun.wait(timeout=1800)
    if rerun.returncode == 0:
        return None
    logs = "\n".join(f"--- {p}\n{p.read_text()[-2500:]}" for p in sorted((wf / "results/small/logs").glob("*.log")))
    stderr = (wf / "rerun.err").read_text()
    return f"snakemake failed ({rerun.returncode}):\n{stderr[-4000:]}\n{logs}"


def sigkill_vllm_mid_generate(wf: Path, run: subprocess.Popen) -> dict:
    """In the rerun, once generate has stored two more replies: SIGKILL of its vLLM API
    server (the supervisor's child, as the OOM killer would), for the stage to restart it."""
    store, deadline = wf / "results/small/generate/store.sqlite", time.monotonic() + 900
    before = stored_replies(store)
    servers = wf / "results/small/logs/servers"
    while time.monotonic() < deadline and run.poll() is None:
        leases = generate_leases(servers)
        if leases and stored_replies(store) >= before + 2:
            supervisor = leases[0]["pgid"]
            children = [pid for pid in group_members(supervisor) if parent_pid(pid) == supervisor]
            if children:
                os.kill(children[0], signal.SIGKILL)
                return {"stored_before_rerun": before, "stored_at_kill": stored_replies(store), "killed": children[0]}
        time.sleep(0.1)
    return {"stored_before_rerun": before, "killed": None}


def hard_kill_mid_generate(wf: Path, cmd: list[str]) -> dict:
    """kill -9 of Snakemake's process group once generate's vLLM has its engine process (the
    moment that leaves the most processes behind, and the cheapest: no reply is waited for)."""
    run = subprocess.Popen(cmd, cwd=wf, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    servers, deadline = wf / "results/small/logs/servers", time.monotonic() + 900
    while not any(engine_started(lease["pgid"]) for lease in generate_leases(servers)):
        assert run.poll() is None and time.monotonic() < deadline, "generate's vLLM never started its engine"
        time.sleep(0.2)
    os.killpg(run.pid, signal.SIGKILL)
    run.wait()
    killed_at = stored_replies(wf / "results/small/generate/store.sqlite")
    leases = [json.loads(p.read_text()) for p in servers.glob("vllm-*.json")]
    # The supervisor SIGTERMs the group, and SIGKILLs it after the grace period: a vLLM still
    # importing its modules answers SIGTERM late or never.
    deadline = time.monotonic() + ServerSpec.stop_grace_s + 10
    while any(group_members(lease["pgid"]) for lease in leases) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [pid for lease in leases for pid in group_members(lease["pgid"])]
    return {"stored_at_kill": killed_at, "leases": len(leases), "vllm_processes_left": left}


def generate_leases(servers: Path) -> list[dict]:
    """The leases of generate's vLLM servers (the baseline's may run before generate)."""
    leases = []
    for path in servers.glob("vllm-*.json"):
        try:
            lease = json.loads(path.read_text())
        except (OSError, ValueError):  # removed or being written
            continue
        if Path(lease["log"]).name.startswith("generate."):
            leases.append(lease)
    return leases


def engine_started(pgid: int) -> bool:
    """Whether vLLM's group has its engine-core process (titled VLLM::EngineCore)."""
    for pid in group_members(pgid):
        try:
            if Path(f"/proc/{pid}/comm").read_text().startswith("VLLM::Engine"):
                return True
        except OSError:
            continue
    return False
