"""The server lifecycle: healthy start, clear errors, and no process left behind."""

import asyncio
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import httpx2
import pytest

from devkit.configs import server_config
from eagleflow.runtime import spec as spec_module
from eagleflow.runtime.leases import Lease
from eagleflow.runtime.process import group_alive, group_members, parent_pid, start_time
from eagleflow.runtime.recovery import RestartDeadServer
from eagleflow.runtime.server_args import result_args
from eagleflow.runtime.spec import ServerError, ServerSpec
from eagleflow.runtime.vllm_server import VllmServer, free_port

# A stand-in for vLLM's process tree: a parent serving /health, plus a forked worker that
# ignores SIGTERM (as a wedged engine worker does), so the SIGKILL path is exercised too.
FAKE_SERVER = textwrap.dedent(
    """
    import http.server, os, signal, sys, time
    port, delay, die = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3] == "die"
    if os.fork() == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        while True:
            time.sleep(1)
    print("fake server starting", flush=True)
    time.sleep(delay)
    if die:
        print("CUDA out of memory (simulated)", flush=True)
        sys.exit(3)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404); self.end_headers()
        def log_message(self, *a): pass
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
    """
)


def fake_spec(env: dict | None = None, **overrides) -> ServerSpec:
    spec = ServerSpec.from_config(server_config(), "fake", env=env or {}, **overrides)
    return FakeSpec(**{f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)})


class FakeSpec(ServerSpec):
    def command(self, port):
        return [
            sys.executable,
            "-c",
            FAKE_SERVER,
            str(port),
            str(self.env.get("DELAY", "0.5")),
            self.env.get("MODE", "ok"),
        ]


def test_server_group_is_killed_including_workers_that_ignore_sigterm(tmp_path):
    spec = fake_spec(startup_timeout_s=30, stop_grace_s=2)
    with VllmServer(spec, tmp_path / "server.log") as srv:
        pgid = srv.proc.pid
        assert group_alive(pgid)
    assert not group_alive(pgid)


def test_a_stopped_server_takes_its_scratch_directories_along_and_a_crashed_one_leaves_them(tmp_path):
    """What a server writes for its clients (the extraction's states files) goes when it is
    stopped; after a crash the clients that restart it still read what it wrote."""
    stopped, crashed = tmp_path / "stopped", tmp_path / "crashed"
    for scratch in (stopped, crashed):
        (scratch / "sub").mkdir(parents=True)
        (scratch / "sub/unread.safetensors").write_bytes(b"states")
    spec = fake_spec(startup_timeout_s=30, stop_grace_s=2, scratch_dirs=(str(stopped),))
    with VllmServer(spec, tmp_path / "ok.log") as srv:
        assert stopped.is_dir()
        pgid = srv.proc.pid
    deadline = time.monotonic() + 10
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not stopped.exists()
    spec = fake_spec(
        {"MODE": "die", "DELAY": "0.2"}, startup_timeout_s=30, stop_grace_s=2, scratch_dirs=(str(crashed),)
    )
    with pytest.raises(ServerError), VllmServer(spec, tmp_path / "die.log"):
        pass
    assert (crashed / "sub/unread.safetensors").read_bytes() == b"states"


def test_server_that_dies_raises_with_log_tail(tmp_path):
    spec = fake_spec({"MODE": "die", "DELAY": "0.2"}, startup_timeout_s=30, stop_grace_s=2)
    with pytest.raises(ServerError) as exc:
        with VllmServer(spec, tmp_path / "server.log"):
            pass
    assert "exited with code 3" in str(exc.value)
    assert "CUDA out of memory (simulated)" in str(exc.value)


def test_server_that_never_gets_healthy_times_out_and_is_killed(tmp_path):
    spec = fake_spec({"DELAY": "60"}, startup_timeout_s=2, stop_grace_s=2)
    server = VllmServer(spec, tmp_path / "server.log")
    with pytest.raises(ServerError, match="did not answer .*within 2 s"):
        with server:
            pass
    assert server.proc is None


def test_a_launched_server_that_dies_is_restarted_on_its_port_until_max_restarts(tmp_path, caplog):
    """The fake's API process is SIGKILLed (as the OOM killer would): recovery restarts the
    group on the same URL and says why; once max_restarts is spent it raises with the cause."""
    spec = fake_spec(startup_timeout_s=30, stop_grace_s=2)
    with VllmServer(spec, tmp_path / "server.log") as srv:
        recovery = RestartDeadServer(srv, max_restarts=1)
        url = srv.base_url
        assert asyncio.run(recovery.recover(url, "a healthy server")) is False and recovery.restarts == 0
        for expected in ("restarted", "spent"):
            api = [pid for pid in group_members(srv.proc.pid) if parent_pid(pid) == srv.proc.pid]
            os.kill(api[0], signal.SIGKILL)
            if expected == "restarted":
                with caplog.at_level(logging.WARNING):
                    assert asyncio.run(recovery.recover(url, "ConnectError")) is True
                assert srv.base_url == url and httpx2.get(f"{url}/health").status_code == 200
                assert "died while serving (killed by SIGKILL)" in caplog.text and "Restart 1 of 1" in caplog.text
            else:
                with pytest.raises(ServerError, match=r"killed by SIGKILL\), after 1 restart\(s\) .*max_restarts: 1"):
                    asyncio.run(recovery.recover(url, "ConnectError"))


def test_command_binds_loopback_and_uses_python_m(monkeypatch):
    def command(**overrides):
        return ServerSpec.from_config(
            server_config(dtype="float32", enforce_eager=True),
            "m",
            speculative_config={"method": "eagle3", "model": "d", "num_speculative_tokens": 3},
            **overrides,
        ).command(8000)

    monkeypatch.setattr(spec_module, "vllm_cpu_installed", lambda: False)
    cmd = command()
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert "--enforce-eager" in cmd
    assert '"method": "eagle3"' in cmd[cmd.index("--speculative-config") + 1]
    # vllm-cpu: the same server through the entry that forks its engine core, with the same
    # flags, so the same keys for every reply and state.
    monkeypatch.setattr(spec_module, "vllm_cpu_installed", lambda: True)
    cpu = command()
    assert cpu[1:3] == ["-m", "eagleflow.runtime.vllm_cpu_entry"]
    assert cpu[3:] == cmd[3:] and result_args(cpu) == result_args(cmd)
    # A stage's wrapper keeps vllm-cpu's spawn (vllm_cpu_entry.py says why); a user's
    # launcher is run as it is.
    assert command(entry_module="eagleflow.benchmark.vllm_serve")[1:3] == ["-m", "eagleflow.benchmark.vllm_serve"]
    assert command(launcher=["my-vllm"])[0] == "my-vllm"


# That no vLLM process outlives a SIGKILLed job is checked with a real vLLM in the shared DAG
# run (tests/integration/conftest.py: kill -9 of Snakemake's whole process group mid-run);
# the tests here use a fake process tree through the same launcher and supervisor.


# A job that launches a fake server and waits; killed from outside.
FAKE_JOB = textwrap.dedent(
    """
    import sys, time
    from tests.integration.test_server import fake_spec
    from eagleflow.runtime.vllm_server import VllmServer
    with VllmServer(fake_spec(startup_timeout_s=30, stop_grace_s=2), sys.argv[1]) as srv:
        print("READY", srv.proc.pid, flush=True)
        time.sleep(3600)
    """
)


def test_sigkilled_job_takes_its_server_group_along_and_the_next_job_clears_the_lease(tmp_path):
    """SIGKILL runs no cleanup in the job: the supervisor, told by the kernel, stops the
    group (including a worker that ignores SIGTERM). The dead job's lease is what remains,
    and the next launch removes it."""
    job = subprocess.Popen(
        [sys.executable, "-c", FAKE_JOB, str(tmp_path / "logs/a.log")], stdout=subprocess.PIPE, text=True
    )
    try:
        line = job.stdout.readline()
        assert line.startswith("READY"), line
        pgid = int(line.split()[1])
        assert len(group_members(pgid)) >= 3  # supervisor, server, its worker
        assert (tmp_path / f"logs/servers/vllm-{pgid}.json").is_file()
        job.kill()
        job.wait(timeout=10)
        deadline = time.monotonic() + 10
        while group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not group_alive(pgid), "the server outlived a SIGKILLed job"
    finally:
        if job.poll() is None:
            job.kill()
    with VllmServer(fake_spec(startup_timeout_s=30, stop_grace_s=2), tmp_path / "logs/b.log") as srv:
        assert [p.name for p in (tmp_path / "logs/servers").glob("vllm-*.json")] == [f"vllm-{srv.proc.pid}.json"]
    assert list((tmp_path / "logs/servers").glob("vllm-*.json")) == []


def test_a_leftover_server_of_a_dead_job_is_stopped_by_the_next_one(tmp_path, caplog):
    """What the supervisor cannot cover (it was SIGKILLed itself): a live server group whose
    lease names a dead owner. The next job's launch stops it and names it in its log."""
    leftover = subprocess.Popen(
        FakeSpec(**{f.name: getattr(fake_spec(), f.name) for f in dataclasses.fields(ServerSpec)}).command(free_port()),
        start_new_session=True,
        stdout=subprocess.DEVNULL,
    )
    dead = subprocess.Popen(["true"])
    dead.wait()
    lease_dir = tmp_path / "logs/servers"
    lease = Lease(
        pgid=leftover.pid,
        leader_started=start_time(leftover.pid),
        owner_pid=dead.pid,
        owner_started=12345,
        port=1,
        model="fake",
        job="snakemake ... (simulated)",
        log="x.log",
    )
    lease_dir.mkdir(parents=True)
    (lease_dir / f"vllm-{leftover.pid}.json").write_text(json.dumps(dataclasses.asdict(lease)))
    # A lease of a live job (this test process) is not ours to touch.
    alive = dataclasses.replace(lease, pgid=os.getpid(), owner_pid=os.getpid(), owner_started=start_time(os.getpid()))
    (lease_dir / f"vllm-{os.getpid()}.json").write_text(json.dumps(dataclasses.asdict(alive)))
    deadline = time.monotonic() + 30  # the fake forks its worker; a loaded machine takes a while
    while len(group_members(leftover.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(group_members(leftover.pid)) == 2
    with (
        caplog.at_level(logging.WARNING),
        VllmServer(fake_spec(startup_timeout_s=30, stop_grace_s=2), tmp_path / "logs/b.log"),
    ):
        pass
    assert (
        f"stopping a vLLM server left behind by a dead job: process group {leftover.pid} (2 processes)" in caplog.text
    )
    assert not group_alive(leftover.pid)
    assert sorted(p.name for p in lease_dir.glob("vllm-*.json")) == [f"vllm-{os.getpid()}.json"]


# --- a server shared by the jobs of a phase ----------------------------------------------


def test_a_shared_server_outlives_its_launcher_keeps_its_gpus_and_stops_after_the_linger(tmp_path, monkeypatch):
    from eagleflow.runtime.gpus import claim_gpus
    from eagleflow.runtime.ledger import read_loads
    from eagleflow.runtime.shared_server import SharedServer, Sharing

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setenv("EAGLEFLOW_GPU_LOCK_DIR", str(tmp_path / "gpu-locks"))
    spec = fake_spec(startup_timeout_s=30, stop_grace_s=2)
    sharing = Sharing(name="hidden_states", linger_s=3, gpus=1)
    servers = tmp_path / "logs/servers"
    with SharedServer(spec, sharing, servers) as first:
        pgid, url = first.state["pgid"], first.base_url
    # The launching job is done; the server and the device it locked stay.
    assert group_alive(pgid)
    with pytest.raises(RuntimeError, match="could not lock 2"):
        claim_gpus(2, ["0", "1"], tmp_path / "gpu-locks", timeout_s=0.3)
    with SharedServer(spec, sharing, servers) as second:  # the next job, within the linger time
        assert (second.state["pgid"], second.base_url) == (pgid, url)
    assert [(r["stage"], r["kind"], r["shared"]) for r in read_loads(servers)] == [("hidden_states", "start", True)]
    deadline = time.monotonic() + 30
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not group_alive(pgid)
    assert claim_gpus(2, ["0", "1"], tmp_path / "gpu-locks", timeout_s=5).devices == ["0", "1"]
    assert list(servers.glob("vllm-*.json")) == []


def test_a_shared_server_that_dies_is_restarted_once_for_every_job(tmp_path):
    from eagleflow.runtime.ledger import read_loads
    from eagleflow.runtime.recovery import RestartSharedServer
    from eagleflow.runtime.shared_server import SharedServer, Sharing, stop_idle_shared_servers

    spec = fake_spec(startup_timeout_s=30, stop_grace_s=2)
    sharing = Sharing(name="hidden_states", linger_s=60)
    servers = tmp_path / "logs/servers"
    with SharedServer(spec, sharing, servers) as a, SharedServer(spec, sharing, servers) as b:
        old = a.state["pgid"]
        child = next(pid for pid in group_members(old) if parent_pid(pid) == old)
        os.kill(child, signal.SIGKILL)  # the OOM killer takes the server

        async def both_recover():
            return await asyncio.gather(
                RestartSharedServer(a, 3).recover(a.base_url, "connection lost"),
                RestartSharedServer(b, 3).recover(b.base_url, "connection lost"),
            )

        assert asyncio.run(both_recover()) == [True, True]
        assert a.state["pgid"] == b.state["pgid"] != old and a.base_url == b.base_url
    kinds = [r["kind"] for r in read_loads(servers)]
    assert kinds == ["start", "restart"]  # one restart, whichever job saw the death first
    # The phase is over: the index job stops the idle server at once, not after the linger.
    assert stop_idle_shared_servers(servers, "hidden_states") == 1
    assert not group_alive(a.state["pgid"]) and list(servers.glob("vllm-*.json")) == []
