"""A finished run put in a bucket as a run there would have left it, for the tests that run
the DAG under Snakemake's S3 storage provider."""

from pathlib import Path

import boto3

from devkit.seaweedfs import SeaweedFS

BUCKET = "eagleflow"
PREFIX = f"s3://{BUCKET}/run"
STORAGE = ["--default-storage-provider", "s3", "--default-storage-prefix", PREFIX]
# What the run in the bucket starts from: the prepared verifier and every output upstream of
# the extraction and of training (logs and benchmarks are no job's input).
KEPT = ("resources/verifier/", "results/small/prompts/", "results/small/generate/", "results/small/synth/",
        "results/small/dataset/", "results/small/vocab/", "results/small/benchmark_sets/")  # fmt: skip


def client(server: SeaweedFS):
    return boto3.client(
        "s3",
        endpoint_url=server.endpoint,
        aws_access_key_id=server.access_key,
        aws_secret_access_key=server.secret_key,
        region_name="us-east-1",
    )


def put_run(wf: Path, s3) -> int:
    """The finished run's files under KEPT as objects under PREFIX, in the order the DAG made
    them (the storage's write times stand for the files'), then its local results and
    resources moved aside (`results-on-disk`, `resources-on-disk`): only the bucket holds the
    run. Returns how many files it put."""
    s3.create_bucket(Bucket=BUCKET)
    files = sorted(
        (p for p in wf.rglob("*") if p.is_file() and str(p.relative_to(wf)).startswith(KEPT)),
        key=lambda p: p.stat().st_mtime_ns,
    )
    for path in files:
        s3.upload_file(str(path), BUCKET, f"run/{path.relative_to(wf)}")
    (wf / "results").rename(wf / "results-on-disk")
    (wf / "resources").rename(wf / "resources-on-disk")
    return len(files)


def objects(s3, prefix: str) -> dict[str, int]:
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return {o["Key"]: o["Size"] for page in pages for o in page.get("Contents", [])}
