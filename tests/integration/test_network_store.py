"""The response store on a network filesystem, seen by two hosts (tests/network_fs/two_hosts.sh:
one export on loopback, mounted twice over SFTP, each mount its own client as two cluster nodes
are of an NFS share).

The failure the store's locking guards against is reproduced first: SQLite's locks taken
through one mount do not reach the other, so two writers both hold the write lock. Then what
`generate.store_locking: auto` does about it: the store opens exclusively there (one process,
no shared memory, an owner file), the other host is refused by name, a writer killed mid-way
loses no reply, and two generate shards on the two hosts, each writing its own store file,
join to one job's replies."""

import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from devkit.fake_openai import fake_openai_server as fake_openai
from eagleflow.common.replies import read_replies
from eagleflow.runtime.response_store import ResponseStore, StoreError, filesystem_type, resolve_locking
from tests.helpers import REPO
from tests.integration.test_generate import finish, join, shard_job, shards_of, synth_job, write_prompts

TWO_HOSTS = REPO / "tests/network_fs/two_hosts.sh"


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    """(host A's view, host B's view) of one exported directory."""
    if os.geteuid() != 0:
        pytest.skip(f"not root: {TWO_HOSTS} must run as root to install sshfs and mount the export")
    if not Path("/dev/fuse").exists():
        pytest.skip("no /dev/fuse: this machine cannot mount a FUSE filesystem")
    d = tmp_path_factory.mktemp("network-fs")
    up = subprocess.run([str(TWO_HOSTS), "up", str(d)], capture_output=True, text=True, timeout=300)
    if up.returncode != 0:
        pytest.fail(f"{TWO_HOSTS} up failed ({up.returncode}):\n{up.stderr[-3000:]}")
    try:
        yield d / "host-a", d / "host-b"
    finally:
        subprocess.run([str(TWO_HOSTS), "down", str(d)], capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def verifier(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("verifier")
    (d / "config.json").write_text(json.dumps({"model_type": "fake"}))
    return d


def both_take_the_write_lock(first: Path, second: Path) -> bool:
    """Whether two shared (WAL) stores opened as `first` and `second` both get SQLite's
    write lock at once."""
    one, two = ResponseStore(first, "shared"), ResponseStore(second, "shared", busy_timeout_s=0.5)
    try:
        one._db.execute("BEGIN IMMEDIATE")
        try:
            two._db.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            assert "locked" in str(exc)
            return False
        two._db.execute("ROLLBACK")
        return True
    finally:
        one._db.execute("ROLLBACK")
        one.close()
        two.close()


def test_sqlites_locks_do_not_reach_the_other_host_so_the_store_opens_exclusively_there(hosts, tmp_path):
    a, b = hosts
    # The failure mode: through two mounts, two writers hold the write lock at once.
    assert both_take_the_write_lock(a / "wal.sqlite", b / "wal.sqlite")
    assert not both_take_the_write_lock(tmp_path / "wal.sqlite", tmp_path / "wal.sqlite")  # one disk: refused
    assert filesystem_type(a) == "fuse.sshfs" and resolve_locking("auto", a / "store.sqlite") == "exclusive"
    assert resolve_locking("auto", tmp_path / "store.sqlite") == "shared"


def test_the_other_host_is_refused_by_name_and_takes_over_once_the_holder_closes(hosts):
    a, b = hosts
    with ResponseStore(a / "store.sqlite") as store:
        assert store.locking == "exclusive"
        for i in range(20):
            store.put(f"k{i}", {"i": i}, {"reply": i})
        with pytest.raises(StoreError, match=rf"open by process {os.getpid()} on host"):
            ResponseStore(b / "store.sqlite")
        # WAL's index lives in the holder's memory: no shared-memory file on the export.
        assert not (b / "store.sqlite-shm").exists()
    with ResponseStore(b / "store.sqlite") as store:
        assert len(store) == 20 and store.get("k7") == {"reply": 7}
    assert not (a / "store.sqlite.owner").exists()


WRITER = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {repo!r})
    from eagleflow.runtime.response_store import ResponseStore
    store = ResponseStore({path!r})
    for i in range(40):
        store.put(f"k{{i}}", {{"i": i}}, {{"reply": i}})
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_a_writer_killed_on_one_host_loses_no_reply(hosts):
    a, b = hosts
    code = WRITER.format(repo=str(REPO), path=str(a / "killed.sqlite"))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    assert (b / "killed.sqlite.owner").exists()  # its owner file outlived it
    # Both mounts are this machine's: the holder is known gone and its store taken over.
    with ResponseStore(b / "killed.sqlite") as store:
        assert len(store) == 40 and store.get("k39") == {"reply": 39}


def test_two_shards_on_two_hosts_join_to_one_jobs_replies(hosts, verifier, tmp_path):
    a, b = hosts
    prompts = tmp_path / "prompts.jsonl"
    write_prompts(prompts, 40)  # 48 requests
    with fake_openai("--latency", "0.05", "--lifetime", "300") as url:
        finish(synth_job(prompts, url, tmp_path / "one", verifier))
        # The run directory on the export; shard 0 runs on host A, shard 1 on host B, at once.
        jobs = [
            shard_job(prompts, url, host / "run", verifier, part)
            for host, part in zip((a, b), shards_of(2), strict=True)
        ]
        for job in jobs:
            finish(job)
    stats = join(prompts, a / "run", 2)
    assert stats["sent"] == 48 and stats["conversations"] == 40
    assert sorted(p.name for p in (a / "run").glob("store*")) == ["store.0-of-2.sqlite", "store.1-of-2.sqlite"]

    def rows(path):
        return [(r["id"], r["key"], json.dumps(r["response"])) for r in read_replies(path)]

    assert rows(b / "run/replies.parquet") == rows(tmp_path / "one/replies.parquet")
