"""The stores in a bucket, against a real S3 server: SeaweedFS's `weed mini` on loopback
(devkit/seaweedfs.py). The per-sample hidden-state store (`storage.states`: extraction by the
hf backend on a tiny Llama, training's reads through the bounded local cache, prune), the
response store (`storage.responses`), credentials, and a server killed in the middle of an
upload."""

import json
import os
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from devkit.seaweedfs import SeaweedFS
from eagleflow.hidden_states.index import write_index_of_parts
from eagleflow.runtime import object_store
from eagleflow.runtime.checkpoint_mirror import BucketCheckpoints
from eagleflow.runtime.object_store import Bucket, ObjectStoreError, check_access
from eagleflow.runtime.response_store import BUCKET_ENV, ResponseStore
from eagleflow.runtime.state_store import prune_unreferenced
from eagleflow.train.data import ShardSamples
from tests.helpers import write_dataset
from tests.unit.test_hidden_states import run_hf_part


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    server = SeaweedFS(tmp_path_factory.mktemp("seaweedfs")).start()
    yield server
    server.stop()


def use(monkeypatch, env: dict[str, str]) -> None:
    """This process's S3 client from `env` alone (no credentials of the machine's)."""
    for name in ("ENDPOINT_URL", "ACCESS_KEY", "SECRET_KEY", "TOKEN", "REGION"):
        monkeypatch.delenv(object_store.ENV_PREFIX + name, raising=False)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    object_store.client.cache_clear()


@pytest.fixture
def s3_env(s3, monkeypatch):
    use(monkeypatch, s3.env())
    yield s3
    object_store.client.cache_clear()


def objects(url: str) -> dict[str, int]:
    return dict(Bucket(url).listing())


def test_states_go_to_the_bucket_once_and_a_grown_dataset_uploads_only_its_new_samples(
    s3_env, tiny_llama_dir, tmp_path
):
    store = f"s3://states/{tmp_path.name}"
    rows = write_dataset(tmp_path, n=7)
    parts = [tmp_path / f"hs/part-{k:05d}.json" for k in range(2)]
    first = [run_hf_part(tmp_path, tiny_llama_dir, k, str(p), 2, store_location=store) for k, p in enumerate(parts)]
    assert {m["store"] for m in first} == {store}
    assert sum(m["stats"]["uploaded_samples"] for m in first) == 7 and len(objects(store)) == 7
    assert not (tmp_path / "hs/samples").exists()  # nothing stored beside the manifests

    # The same data stored on the filesystem: the bucket decides no byte of it.
    local = tmp_path / "local"
    local.mkdir()
    for name in ("train.parquet", "eval.parquet"):
        (local / name).write_bytes((tmp_path / name).read_bytes())
    kept = [run_hf_part(local, tiny_llama_dir, k, str(local / f"hs/part-{k:05d}.json"), 2) for k in range(2)]
    assert [s["digest"] for m in kept for s in m["samples"]] == [s["digest"] for m in first for s in m["samples"]]

    # Three new conversations, and one changed: only those four are extracted and uploaded.
    new = [
        {**rows[0], "id": f"n{i}", "input_ids": [9, 8, 7 + i, 6], "loss_mask": [0, 1, 1, 1], "length": 4}
        for i in range(3)
    ]
    changed = {**rows[1], "input_ids": rows[1]["input_ids"][:-1] + [11], "loss_mask": rows[1]["loss_mask"]}
    pq.write_table(pa.Table.from_pylist([rows[0], changed, *rows[2:5], *new]), tmp_path / "train.parquet")
    before = objects(store)
    second = [run_hf_part(tmp_path, tiny_llama_dir, k, str(p), 2, store_location=store) for k, p in enumerate(parts)]
    assert sum(m["stats"]["uploaded_samples"] for m in second) == 4
    assert sum(m["stats"]["stored_samples"] for m in second) == 6
    after = objects(store)
    assert len(after) == 11 and set(before) < set(after)

    # Training reads every sample back through its local cache, as the filesystem's index gives it.
    index = tmp_path / "hs/index.json"
    doc = write_index_of_parts([str(p) for p in parts], str(tiny_llama_dir), str(index))
    assert doc["store"] == store and all(s["file"].startswith(store + "/") for s in doc["samples"])
    storage = {"cache_gb": 1e-6, "fetch_threads": 4, "cache_dir": str(tmp_path / "cache")}
    source = ShardSamples.from_index(index, storage=storage)
    refs = [r for split in source.refs() for r in split]
    ids = {loc.file: loc.id for loc in source.located}
    want = {r["id"]: r["input_ids"] for r in [rows[0], changed, *rows[2:], *new]}
    got = source.samples(refs)  # each checked against the digest its manifest recorded
    assert sorted(ids[r.shard] for r in refs) == sorted(want) and len(got) == 10
    for ref, sample in zip(refs, got, strict=True):
        assert sample.input_ids.tolist() == list(want[ids[ref.shard]])[-len(sample) :]  # shifted by one
    assert source.fetch.fetched == 10
    # A cache of a byte keeps the batch it was last asked for, and nothing besides.
    one_by_one = ShardSamples.from_index(index, storage={**storage, "cache_dir": str(tmp_path / "cache1")})
    for ref in refs:
        one_by_one.samples([ref])
    assert one_by_one.fetch.fetched == 10 and len(list((tmp_path / "cache1").rglob("*.safetensors"))) == 1

    # Prune drops the changed sample's old object, which nothing names any more.
    pruned = prune_unreferenced(tmp_path / "hs")
    assert [(where, n) for where, n, _ in pruned] == [(store, 1)] and len(objects(store)) == 10

    # An object changed behind the workflow's back is refused, not trained on.
    victim, other = doc["samples"][0], doc["samples"][1]
    body = object_store.client().get_object(Bucket="states", Key=other["file"][len("s3://states/") :])["Body"].read()
    object_store.client().put_object(Bucket="states", Key=victim["file"][len("s3://states/") :], Body=body)
    fresh = ShardSamples.from_index(index, storage={**storage, "cache_dir": str(tmp_path / "cache2")})
    k = fresh.files.index(victim["file"])
    with pytest.raises(ObjectStoreError, match="changed after it was written"):
        fresh.samples([r for r in fresh.refs()[0] + fresh.refs()[1] if r.shard == k])


def test_missing_or_wrong_credentials_are_named_before_any_work(s3, monkeypatch, tiny_llama_dir, tmp_path):
    url = "s3://states/creds"
    use(monkeypatch, {**s3.env(), "SNAKEMAKE_STORAGE_S3_SECRET_KEY": "not-the-secret"})
    with pytest.raises(ObjectStoreError, match="refused the credentials") as refused:
        check_access(url)
    assert "not-the-secret" not in str(refused.value) and s3.secret_key not in str(refused.value)
    # The extraction job fails on it before it loads anything.
    write_dataset(tmp_path, n=7)
    with pytest.raises(ObjectStoreError, match="refused the credentials"):
        run_hf_part(tmp_path, tiny_llama_dir, 0, str(tmp_path / "hs/part-00000.json"), 1, store_location=url)
    assert not (tmp_path / "logs").exists()
    use(monkeypatch, {"SNAKEMAKE_STORAGE_S3_ENDPOINT_URL": s3.endpoint})
    with pytest.raises(ObjectStoreError, match="no S3 credentials"):
        check_access(url)
    use(monkeypatch, {**s3.env(), "SNAKEMAKE_STORAGE_S3_ENDPOINT_URL": "http://127.0.0.1:9"})
    with pytest.raises(ObjectStoreError, match="cannot be reached"):
        check_access(url)
    object_store.client.cache_clear()


def test_a_server_killed_mid_upload_leaves_no_object_and_a_rerun_uploads_it(monkeypatch, tmp_path):
    server = SeaweedFS(tmp_path / "s3").start()
    try:
        use(monkeypatch, server.env())
        bucket = Bucket("s3://faults/run")
        check_access(bucket.url)
        big = tmp_path / "sample.safetensors"
        big.write_bytes(torch.randint(0, 255, (48 << 20,), dtype=torch.uint8).numpy().tobytes())
        failed: list[BaseException] = []

        def upload():
            try:
                bucket.put_once("ab/sample.safetensors", big, "d1")
            except BaseException as e:  # handed to the test's thread
                failed.append(e)

        writer = threading.Thread(target=upload)
        writer.start()
        deadline = time.monotonic() + 60
        while not object_store.client().list_multipart_uploads(Bucket="faults").get("Uploads"):
            assert time.monotonic() < deadline and writer.is_alive(), "the upload never began as a multipart upload"
            time.sleep(0.05)
        server.kill()
        writer.join(timeout=300)
        assert len(failed) == 1 and isinstance(failed[0], ObjectStoreError), failed
        server.start()
        # What the killed upload sent is no object: a reader finds nothing, and the rerun uploads it.
        assert bucket.recorded_digest("ab/sample.safetensors") is None
        assert bucket.put_once("ab/sample.safetensors", big, "d1")
        assert not bucket.put_once("ab/sample.safetensors", big, "d1")  # never overwritten
        same = lambda p: "d1" if p.read_bytes() == big.read_bytes() else "?"  # noqa: E731
        bucket.fetch("ab/sample.safetensors", tmp_path / "back", "d1", same)
        assert json.dumps(objects(bucket.url)) == json.dumps({"ab/sample.safetensors": big.stat().st_size})
    finally:
        server.stop()
        object_store.client.cache_clear()


def test_replies_reach_the_bucket_as_they_are_stored_and_a_job_elsewhere_asks_none_again(s3_env, monkeypatch, tmp_path):
    monkeypatch.setenv(BUCKET_ENV, f"s3://replies/{tmp_path.name}")
    request = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    with ResponseStore(tmp_path / "node-a/store.sqlite") as a:
        for i in range(5):
            a.put(f"k{i:02d}", request, {"text": f"reply {i}"})
        # Killed between its commit and its upload: the reply is in this copy alone.
        a._insert("k99", *a._row("k00")[1:])
    # Another node's job, with no copy of its own: every published reply, no request.
    with ResponseStore(tmp_path / "node-b/store.sqlite") as b:
        assert b.fetched == 5 and b.get("k03") == {"text": "reply 3"} and b.get("k99") is None
    # The killed job's rerun on its own node publishes what it had not.
    with ResponseStore(tmp_path / "node-a/store.sqlite") as a:
        assert (a.fetched, a.published) == (0, 1)
    with ResponseStore(tmp_path / "node-c/store.sqlite") as c:
        assert c.fetched == 6 and c.get("k99") == {"text": "reply 0"}
        # Prune drops what no request uses, in the bucket too.
        assert c.prune({"k00", "k01"}) == 4
    with ResponseStore(tmp_path / "node-d/store.sqlite") as d:
        assert sorted(d.keys()) == ["k00", "k01"]
    # A reply changed behind the workflow's back is refused, never answered from.
    key = f"{tmp_path.name}/replies/k0/k01"
    object_store.client().put_object(Bucket="replies", Key=key, Body=b"\0" * 16, Metadata={"digest": "x"})
    with pytest.raises(ObjectStoreError, match="does not match the digest"):
        ResponseStore(tmp_path / "node-e/store.sqlite")


def test_checkpoints_copied_to_the_bucket_bring_a_job_elsewhere_to_the_newest_whole_one(s3_env, tmp_path):
    check_access("s3://eagleflow/ckpt")
    directory = Path("results/r/drafts/d/train/checkpoints/0123abcd")
    mirror = BucketCheckpoints.for_job({"checkpoints": "s3://eagleflow/ckpt"}, directory)
    assert mirror.bucket.url == f"s3://eagleflow/ckpt/{directory}"
    assert BucketCheckpoints.for_job({"checkpoints": None}, directory) is None
    node = tmp_path / "node" / directory
    for step in (2, 4, 6):
        path = node / f"step-{step:08d}"
        path.mkdir(parents=True)
        (path / "model.safetensors").write_bytes(os.urandom(4096))
        (path / "state.json").write_text(json.dumps({"step": step}))
        mirror.publish(path, keep=2)
    assert mirror.whole() == ["step-00000004", "step-00000006"]
    assert not [rel for rel in objects(mirror.bucket.url) if rel.startswith("step-00000002/")]
    # A copy cut short (its state.json never uploaded) is not whole: never fetched.
    Bucket(mirror.bucket.url).put("step-00000008/model.safetensors", node / "step-00000006/model.safetensors")
    assert mirror.whole()[-1] == "step-00000006"
    # A job on another node: the newest whole checkpoint, file for file; then nothing to fetch.
    elsewhere = tmp_path / "elsewhere" / directory
    assert mirror.fetch_newest(elsewhere, []) == elsewhere / "step-00000006"
    for name in ("model.safetensors", "state.json"):
        assert (elsewhere / "step-00000006" / name).read_bytes() == (node / "step-00000006" / name).read_bytes()
    assert [p.name for p in elsewhere.iterdir()] == ["step-00000006"]
    assert mirror.fetch_newest(elsewhere, ["step-00000006"]) is None
    assert mirror.fetch_newest(node, ["step-00000004", "step-00000006"]) is None
    mirror.drop()
    assert objects(mirror.bucket.url) == {}
