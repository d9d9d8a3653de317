"""The DAG under Snakemake's S3 storage provider (`--default-storage-provider s3`), against a
real S3 server on loopback (SeaweedFS, devkit/seaweedfs.py).

A copy of the finished test run's outputs up to the dataset and the draft vocabulary is put in
the bucket as a run there would have left them; then the extraction and the training run with
every input, output and store in the bucket: the samples uploaded once and fetched back through
training's cache, nothing left beside the local copies, the draft a directory of objects. The
S3 server crashes once training has copied a checkpoint to the bucket; the node's own
checkpoints are deleted (a job resubmitted to another node finds none), and the rerun resumes
from the bucket's. A second dry run plans nothing, and an edit of the index's code restales on
the bucket exactly what it restales on the filesystem."""

import json
import os
import shutil
import subprocess
import time

import pytest
import torch
import yaml
from safetensors.torch import load

from devkit.runs import copy_finished_run, planned_jobs
from devkit.seaweedfs import SeaweedFS
from tests.helpers import REPO, SNAKEMAKE
from tests.object_storage import PREFIX, STORAGE, client, objects, put_run

# A checkpoint every two of the run's 20 steps (no result changes with it): the S3 server is
# killed after the first is copied to the bucket. Written into the run's copy by the fixture.
CONFIG = ["--configfile", str(REPO / "tests/config/small.yaml"), "checkpoints.yaml"]
MIRROR = "run/results/small/drafts/default/train/checkpoints/"


def snakemake(wf, env, *args) -> str:
    proc = subprocess.run([*SNAKEMAKE, *CONFIG, *args], cwd=wf, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def on_a_bucket(finished_run, module_tmp):
    server = SeaweedFS(module_tmp / "s3").start()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SNAKEMAKE", "AWS_"))} | server.env()
    s3 = client(server)
    wf = copy_finished_run(finished_run, module_tmp / "wf")
    (wf / "checkpoints.yaml").write_text(yaml.safe_dump({"train": {"checkpoint_every": 2}}))
    put_run(wf, s3)
    out = snakemake(wf, env, "--cores", "2", "--until", "hidden_states_index", *STORAGE)
    # The S3 server crashes while the train job reads its states, once it has copied a
    # checkpoint to the bucket: the job fails, naming the endpoint, and nothing of it is taken
    # as finished. Its checkpoints on this node are deleted, as a job resubmitted to another
    # node finds none; started again, the rerun resumes from the bucket's and completes.
    cmd = [*SNAKEMAKE, *CONFIG, "--cores", "2", "--until", "train", *STORAGE]
    crashed = subprocess.Popen(cmd, cwd=wf, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    train_log = wf / ".snakemake/storage/s3/eagleflow/run/results/small/logs/train.default.log"
    deadline = time.monotonic() + 600
    while "copied to s3://" not in (train_log.read_text() if train_log.exists() else ""):
        assert crashed.poll() is None and time.monotonic() < deadline, "the train job copied no checkpoint"
        time.sleep(0.05)
    server.kill()
    failed = crashed.communicate(timeout=600)[0]
    failed_log = train_log.read_text()
    local = wf / "results/small/drafts/default/train/checkpoints"
    on_the_node = sorted(p.name for p in local.glob("*/step-*"))
    shutil.rmtree(local)
    server.start()
    in_the_bucket = sorted(key.split("/")[-2] for key in objects(s3, MIRROR) if key.endswith("/state.json"))
    out += snakemake(wf, env, "--cores", "2", "--until", "train", *STORAGE)
    crash = {
        "code": crashed.returncode,
        "out": failed,
        "log": failed_log,
        "on_the_node": on_the_node,
        "in_the_bucket": in_the_bucket,
    }
    yield {"wf": wf, "env": env, "s3": s3, "out": out, "crash": crash, "finished": finished_run}
    server.stop()


def test_extraction_and_training_keep_everything_in_the_bucket(on_a_bucket):
    wf, s3, out = on_a_bucket["wf"], on_a_bucket["s3"], on_a_bucket["out"]
    assert f"Object storage: outputs under {PREFIX}" in out and "output cache off" in out
    index = s3.get_object(Bucket="eagleflow", Key="run/results/small/hidden_states/index.json")["Body"].read()
    doc = json.loads(index)
    states = objects(s3, "run/states/small/")
    keys = {s["key"] for s in doc["samples"]}
    assert doc["store"] == f"{PREFIX}/states/small" and len(states) == len(keys) > 0
    # No sample is left on this machine: not beside the local copies, not in a cache.
    assert not [p for p in (wf / ".snakemake").rglob("*.safetensors") if p.stem in keys]
    assert not (wf / "results/small/hidden_states/samples").exists()
    # The draft is a directory of objects, and training read every sample from the bucket.
    assert "run/results/small/drafts/default/draft/model.safetensors" in objects(s3, "run/results/small/drafts/")
    log = s3.get_object(Bucket="eagleflow", Key="run/results/small/logs/train.default.log")["Body"].read().decode()
    assert f"states from {PREFIX}/states/small: {len(states)} files fetched" in log, log[-2000:]


def test_a_crashed_s3_server_fails_the_job_that_needs_it_and_the_rerun_completes(on_a_bucket):
    crash = on_a_bucket["crash"]
    assert crash["code"] != 0 and "Error in rule train" in crash["out"], crash["out"][-3000:]
    assert "the S3 endpoint cannot be reached" in crash["log"], crash["log"][-3000:]


def test_the_rerun_elsewhere_resumes_from_the_buckets_checkpoint_and_trains_the_same_draft(on_a_bucket):
    crash, s3 = on_a_bucket["crash"], on_a_bucket["s3"]
    # The bucket held whole checkpoints, none newer than the node's own before the crash.
    assert crash["in_the_bucket"] and crash["in_the_bucket"][-1] <= crash["on_the_node"][-1], crash
    log = s3.get_object(Bucket="eagleflow", Key="run/results/small/logs/train.default.log")["Body"].read().decode()
    newest = crash["in_the_bucket"][-1]
    assert f"checkpoint {newest} fetched from s3://eagleflow/{MIRROR}" in log, log[-3000:]
    assert f"resuming from step {int(newest.removeprefix('step-'))} of 20" in log, log[-3000:]
    # The draft is the one the finished run trained on the filesystem, uninterrupted, from the
    # same states; the bucket's copies are gone with the training that needed them.
    key = "run/results/small/drafts/default/draft/model.safetensors"
    got = load(s3.get_object(Bucket="eagleflow", Key=key)["Body"].read())
    want = load((on_a_bucket["finished"] / "results/small/drafts/default/draft/model.safetensors").read_bytes())
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert objects(s3, MIRROR) == {}


def test_a_second_run_plans_nothing_and_an_edit_restales_what_it_does_on_a_filesystem(on_a_bucket):
    wf, env = on_a_bucket["wf"], on_a_bucket["env"]
    assert set(planned_jobs(snakemake(wf, env, "-n", "--until", "train", *STORAGE))) <= {"all"}
    index_py = wf / "workflow/eagleflow/hidden_states/index.py"
    original = index_py.read_text()
    index_py.write_text(original + "\nEDITED = True\n")
    try:
        on_bucket = planned_jobs(snakemake(wf, env, "-n", "--until", "train", *STORAGE))
        if (wf / "results").exists():  # what the bucket's jobs left here (none of their outputs)
            (wf / "results").rename(wf / "results-on-bucket")
        (wf / "results-on-disk").rename(wf / "results")
        (wf / "resources-on-disk").rename(wf / "resources")
        on_disk = planned_jobs(snakemake(wf, env, "-n", "--until", "train"))
    finally:
        index_py.write_text(original)
    assert set(on_bucket) == set(on_disk) == {"hidden_states_index", "train"}
    assert "Params have changed" in on_bucket["hidden_states_index"]


def test_a_wrong_or_missing_key_stops_snakemake_before_any_job(on_a_bucket):
    wf, env = on_a_bucket["wf"], on_a_bucket["env"]
    secret = env["SNAKEMAKE_STORAGE_S3_SECRET_KEY"]
    for broken, said in (
        ({**env, "SNAKEMAKE_STORAGE_S3_SECRET_KEY": "not-the-key"}, "refused the credentials"),
        ({k: v for k, v in env.items() if not k.endswith(("_ACCESS_KEY", "_SECRET_KEY"))}, "no S3 credentials"),
    ):
        broken = {**broken, "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent", "AWS_CONFIG_FILE": "/nonexistent"}
        cmd = [*SNAKEMAKE, *CONFIG, "--cores", "2", "--until", "train", "-R", "train", *STORAGE]
        proc = subprocess.run(cmd, cwd=wf, env=broken, capture_output=True, text=True, timeout=600)
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0 and said in out, out[-3000:]
        assert "Select jobs to execute" not in out and secret not in out and "not-the-key" not in out
