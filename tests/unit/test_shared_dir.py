"""The files through which jobs share a server (runtime.shared_server.SharedDir): who counts as a consumer,
and which server counts as running."""

import os
import subprocess
import sys

from eagleflow.runtime.process import start_time
from eagleflow.runtime.shared_server import SharedDir


def test_only_live_jobs_count_as_consumers_and_dead_ones_are_forgotten(tmp_path):
    shared = SharedDir(tmp_path / "shared-x")
    shared.register(os.getpid(), "this test")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone_name = SharedDir.consumer_name(gone.pid)
    gone.wait()
    (shared.consumers / gone_name).write_text("a job that died without unregistering")
    # A file for a reused pid: same pid, another start time.
    (shared.consumers / f"{os.getpid()}-{start_time(os.getpid()) - 1}").write_text("an older process")
    assert shared.live_consumers() == [SharedDir.consumer_name(os.getpid())]
    assert sorted(p.name for p in shared.consumers.iterdir()) == [SharedDir.consumer_name(os.getpid())]


def test_a_server_whose_supervisor_is_gone_is_not_running(tmp_path):
    shared = SharedDir(tmp_path / "shared-x")
    with shared.locked():
        assert shared.live_state() is None
        shared.write_state({"pgid": os.getpid(), "leader_started": start_time(os.getpid()), "port": 1})
        assert shared.live_state()["port"] == 1
        shared.write_state({"pgid": os.getpid(), "leader_started": start_time(os.getpid()) + 1, "port": 1})
        assert shared.live_state() is None
        shared.clear_state(pgid=os.getpid() + 1)  # another server's: kept
        assert shared.read_state() is not None
        shared.clear_state(pgid=os.getpid())
        assert shared.read_state() is None


def test_the_exit_record_drops_the_servers_lease(tmp_path):
    shared = SharedDir(tmp_path / "servers/shared-x")
    shared.path.mkdir(parents=True)
    lease = tmp_path / "servers/vllm-4242.json"
    lease.write_text("{}")
    shared.write_exit(4242, 137)
    assert shared.read_exit(4242) == 137 and shared.read_exit(1) is None
    assert not lease.exists()
