"""The DAG under Snakemake's S3 storage provider (`--default-storage-provider s3`), against a
real S3 server on loopback (SeaweedFS, devkit/seaweedfs.py).

A copy of the finished test run's outputs up to the dataset and the draft vocabulary is put in
the bucket as a run there would have left them; then the extraction and the training run with
every input, output and store in the bucket: the samples uploaded once and fetched back through
training's cache, nothing left beside the local copies, the draft a directory of objects. A
second dry run plans nothing, and an edit of the index's code restales on the bucket exactly
what it restales on the filesystem."""

import json
import os
import subprocess

import pytest

from devkit.runs import copy_finished_run, planned_jobs
from devkit.seaweedfs import SeaweedFS
from tests.helpers import REPO, SNAKEMAKE

CONFIG = ["--configfile", str(REPO / "tests/config/small.yaml")]
PREFIX = "s3://eagleflow/run"
STORAGE = ["--default-storage-provider", "s3", "--default-storage-prefix", PREFIX]
# What the run in the bucket starts from: the prepared verifier and every output upstream of
# the extraction and of training (logs and benchmarks are no job's input).
KEPT = ("resources/verifier/", "results/small/prompts/", "results/small/generate/", "results/small/synth/",
        "results/small/dataset/", "results/small/vocab/", "results/small/benchmark_sets/")  # fmt: skip


def put_run(wf, s3) -> int:
    """The finished run's files under KEPT as objects under PREFIX, in the order the DAG made
    them (the storage's write times stand for the files'). Returns how many."""
    files = sorted(
        (p for p in wf.rglob("*") if p.is_file() and str(p.relative_to(wf)).startswith(KEPT)),
        key=lambda p: p.stat().st_mtime_ns,
    )
    for path in files:
        s3.upload_file(str(path), "eagleflow", f"run/{path.relative_to(wf)}")
    return len(files)


def snakemake(wf, env, *args) -> str:
    proc = subprocess.run([*SNAKEMAKE, *CONFIG, *args], cwd=wf, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def on_a_bucket(finished_run, module_tmp):
    import boto3

    server = SeaweedFS(module_tmp / "s3").start()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SNAKEMAKE", "AWS_"))} | server.env()
    s3 = boto3.client(
        "s3",
        endpoint_url=server.endpoint,
        aws_access_key_id=server.access_key,
        aws_secret_access_key=server.secret_key,
        region_name="us-east-1",
    )
    s3.create_bucket(Bucket="eagleflow")
    wf = copy_finished_run(finished_run, module_tmp / "wf")
    put_run(wf, s3)
    # The same directory, its local results moved aside: only the bucket holds the run.
    (wf / "results").rename(wf / "results-on-disk")
    (wf / "resources").rename(wf / "resources-on-disk")
    out = snakemake(wf, env, "--cores", "2", "--until", "train", *STORAGE)
    yield wf, env, s3, out
    server.stop()


def objects(s3, prefix: str) -> dict[str, int]:
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket="eagleflow", Prefix=prefix)
    return {o["Key"]: o["Size"] for page in pages for o in page.get("Contents", [])}


def test_extraction_and_training_keep_everything_in_the_bucket(on_a_bucket):
    wf, _env, s3, out = on_a_bucket
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


def test_a_second_run_plans_nothing_and_an_edit_restales_what_it_does_on_a_filesystem(on_a_bucket):
    wf, env, _s3, _out = on_a_bucket
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
