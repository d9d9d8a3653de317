"""The finished run that the slow integration tests share (one DAG run with a real vLLM)."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import REPO, SNAKEMAKE, copy_workflow, stored_replies, vllm_available
from workflow_scripts.common.process import group_members


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory):
    """The run every test here reads. It starts with a hard kill: `kill -9` of Snakemake's
    whole process group mid-generate (an OOM kill, a crashed terminal); what the kill left is
    in `hard_kill.json`. Then `--unlock` and the same command, as docs/operations.md says."""
    if not vllm_available():
        pytest.skip("vLLM is not installed")
    wf = copy_workflow(tmp_path_factory.mktemp("wf"))
    cmd = SNAKEMAKE + ["--cores", "2", "--configfile", str(REPO / "tests/config/small.yaml")]
    (wf / "hard_kill.json").write_text(json.dumps(hard_kill_mid_generate(wf, cmd)))
    subprocess.run([*cmd, "--unlock"], cwd=wf, capture_output=True, check=True)
    proc = subprocess.run(cmd, cwd=wf, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        logs = "\n".join(f"--- {p}\n{p.read_text()[-2500:]}" for p in sorted((wf / "results/small/logs").glob("*.log")))
        pytest.fail(f"snakemake failed ({proc.returncode}):\n{proc.stderr[-4000:]}\n{logs}")
    return wf


def hard_kill_mid_generate(wf: Path, cmd: list[str]) -> dict:
    run = subprocess.Popen(cmd, cwd=wf, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    store, deadline = wf / "results/small/generate/store.sqlite", time.monotonic() + 900
    while stored_replies(store) < 3:
        assert run.poll() is None and time.monotonic() < deadline, "generate never stored a reply"
        time.sleep(0.2)
    os.killpg(run.pid, signal.SIGKILL)
    run.wait()
    killed_at = stored_replies(store)
    leases = [json.loads(p.read_text()) for p in (wf / "results/small/logs/servers").glob("vllm-*.json")]
    deadline = time.monotonic() + 15
    while any(group_members(lease["pgid"]) for lease in leases) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [pid for lease in leases for pid in group_members(lease["pgid"])]
    return {"stored_at_kill": killed_at, "leases": len(leases), "vllm_processes_left": left}
