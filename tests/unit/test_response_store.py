"""The response store where it lives (runtime/response_store.py): shared WAL on a local filesystem;
on a network filesystem one process at a time, no shared memory, a second opener refused by
name, a killed holder's replies all kept."""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from eagleflow.runtime.response_store import (
    ResponseStore,
    StoreError,
    filesystem_type,
    older_stores,
    resolve_locking,
    shard_store,
    store_files,
)
from tests.helpers import REPO

MOUNTS = """\
sysfs /sys sysfs rw 0 0
/dev/sda1 / ext4 rw,relatime 0 0
nas:/export/scratch /shared nfs4 rw,relatime,vers=4.2 0 0
/dev/sdb1 /shared/local-cache xfs rw 0 0
lustre@tcp:/fs /lustre lustre rw 0 0
"""


@pytest.mark.parametrize(
    ("path", "kind", "locking"),
    [
        ("/home/me/results/run/generate/store.sqlite", "ext4", "shared"),
        ("/shared/results/run/generate/store.sqlite", "nfs4", "exclusive"),
        ("/shared/local-cache/store.sqlite", "xfs", "shared"),  # the longest mount point decides
        ("/lustre/proj/store.sqlite", "lustre", "exclusive"),
        ("/sharedother/store.sqlite", "ext4", "shared"),  # a prefix of the name is not a mount above it
    ],
)
def test_the_filesystem_decides_the_locking(path, kind, locking):
    assert filesystem_type(os.path.dirname(path), MOUNTS) == kind
    assert resolve_locking("auto", path, MOUNTS) == locking
    assert resolve_locking("shared", path, MOUNTS) == "shared"
    assert resolve_locking("exclusive", path, MOUNTS) == "exclusive"


def test_exclusive_locking_keeps_wal_out_of_shared_memory(tmp_path):
    """WAL's index in a mapped `-shm` file is what does not work across hosts."""
    with ResponseStore(tmp_path / "shared.sqlite", "shared") as store:
        store.put("k", {"q": 1}, {"a": 1})
        assert (tmp_path / "shared.sqlite-shm").exists()
    with ResponseStore(tmp_path / "own.sqlite", "exclusive") as store:
        store.put("k", {"q": 1}, {"a": 1})
        assert not (tmp_path / "own.sqlite-shm").exists()
        assert json.loads((tmp_path / "own.sqlite.owner").read_text())["pid"] == os.getpid()
    assert not (tmp_path / "own.sqlite.owner").exists()
    with ResponseStore(tmp_path / "own.sqlite", "shared") as store:  # the same file, either way
        assert store.get("k") == {"a": 1}


HOLDER = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {repo!r})
    from eagleflow.runtime.response_store import ResponseStore
    store = ResponseStore({path!r}, "exclusive")
    for i in range(50):
        store.put(f"k{{i}}", {{"i": i}}, {{"reply": i}})
    print("stored", flush=True)
    if {kill}:
        os.kill(os.getpid(), signal.SIGKILL)
    sys.stdin.readline()
    """
)


def hold(path, kill: bool) -> subprocess.Popen:
    code = HOLDER.format(repo=str(REPO), path=str(path), kill=kill)
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "stored"
    return proc


def test_a_second_opener_is_refused_naming_the_holder(tmp_path):
    path = tmp_path / "store.sqlite"
    holder = hold(path, kill=False)
    try:
        with pytest.raises(StoreError, match=rf"open by process {holder.pid} on host {socket.gethostname()}"):
            ResponseStore(path, "exclusive")
        # A reader that ignores the owner file still cannot get in: SQLite's exclusive lock holds.
        with pytest.raises(StoreError, match="locked"):
            ResponseStore(path, "shared", busy_timeout_s=0.5)
        cli = [sys.executable, "-m", "eagleflow.generate", "stats", str(path), "--locking", "exclusive"]
        out = subprocess.run(cli, cwd=REPO, capture_output=True, text=True)
        assert out.returncode != 0 and f"process {holder.pid}" in out.stderr
    finally:
        holder.communicate("\n", timeout=30)
    with ResponseStore(path, "exclusive") as store:
        assert len(store) == 50


def test_a_killed_holder_is_taken_over_and_every_reply_it_stored_is_kept(tmp_path):
    path = tmp_path / "store.sqlite"
    holder = hold(path, kill=True)
    assert holder.wait(timeout=30) == -signal.SIGKILL
    assert (tmp_path / "store.sqlite.owner").exists()  # left behind by the kill
    with ResponseStore(path, "exclusive") as store:
        assert len(store) == 50 and store.get("k49") == {"reply": 49}


def test_a_holder_on_another_host_is_never_taken_over(tmp_path):
    path = tmp_path / "store.sqlite"
    owner = {"host": "gpu-node-17", "pid": 1, "started": 0}
    (tmp_path / "store.sqlite.owner").write_text(json.dumps(owner))
    with pytest.raises(StoreError, match=r"process 1 on host gpu-node-17 .* remove .*store\.sqlite\.owner"):
        ResponseStore(path, "exclusive")
    assert not path.exists()  # refused before SQLite touched it


# ----------------------------------------------------------------------------------------
# Sharded generation: one file per shard, the files of other shard counts read


def test_each_shard_has_its_own_file_and_reads_only_other_counts_files(tmp_path):
    base = tmp_path / "store.sqlite"
    assert shard_store(base, 0, 1) == base
    assert shard_store(base, 1, 4) == tmp_path / "store.1-of-4.sqlite"
    for path in (base, *(shard_store(base, i, n) for n in (2, 3) for i in range(n))):
        ResponseStore(path, "shared").close()
    (tmp_path / "store.notes.sqlite").write_text("")  # not a shard's file
    (tmp_path / "other.0-of-2.sqlite").write_text("")  # another store's
    assert [p.name for p in store_files(base)] == [
        "store.sqlite",
        "store.0-of-2.sqlite",
        "store.0-of-3.sqlite",
        "store.1-of-2.sqlite",
        "store.1-of-3.sqlite",
        "store.2-of-3.sqlite",
    ]
    # Never the files of its own count: other conversations, perhaps being written right now.
    assert {p.name for p in older_stores(base, 2)} == {
        "store.sqlite",
        "store.0-of-3.sqlite",
        *["store.1-of-3.sqlite", "store.2-of-3.sqlite"],
    }
    assert {p.name for p in older_stores(base, 1)} == {p.name for p in store_files(base)} - {"store.sqlite"}


@pytest.mark.parametrize("locking", ["shared", "exclusive"])
def test_a_reply_an_older_store_holds_is_copied_in_and_the_older_one_let_go(tmp_path, locking):
    old = tmp_path / "store.sqlite"
    with ResponseStore(old, locking) as store:
        store.put("k1", {"q": 1}, {"a": 1})
    own = shard_store(old, 0, 2)
    with ResponseStore(own, locking, older=[old]) as store:
        assert store.get("k1") == {"a": 1} and store.get("k2") is None
        assert store.adopted == 1 and len(store) == 1
        store.close_older()
        if locking == "exclusive":
            assert not (tmp_path / "store.sqlite.owner").exists()
        with ResponseStore(old, locking) as again:  # let go: another job may open it
            assert len(again) == 1
    with ResponseStore(own, locking) as store:
        assert store.get("k1") == {"a": 1}  # kept in the shard's own file


def test_an_older_store_another_process_holds_exclusively_is_waited_for_then_refused(tmp_path):
    old = tmp_path / "store.sqlite"
    holder = hold(old, kill=False)
    try:
        with ResponseStore(shard_store(old, 0, 2), "exclusive", busy_timeout_s=0.2, older=[old]) as store:
            with pytest.raises(StoreError, match=f"process {holder.pid}"):
                store.get("k1")
    finally:
        holder.communicate("\n", timeout=30)
    with ResponseStore(shard_store(old, 0, 2), "exclusive", older=[old]) as store:
        assert store.get("k1") == {"reply": 1}
