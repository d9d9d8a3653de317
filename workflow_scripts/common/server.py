"""Launch and stop vLLM's OpenAI-compatible server for any rule.

One implementation for every stage that needs a server (generate, benchmark, the vLLM
hidden-state backend). The server runs in its own process group so that stopping it also
stops the engine-core and worker processes it forks (an 8-GPU host otherwise keeps zombie
workers holding GPU memory). The group is killed on success, on failure and on SIGTERM.

A job can also die without running any cleanup (SIGKILL, the OOM killer, `kill -9` of
Snakemake's process group). Two things make sure its server does not outlive it:
- The group's leader is a supervisor (common.supervise) that the kernel signals when the
  job dies, and that then stops the group.
- Every launched server has a lease, `<log dir>/servers/vllm-<pgid>.json` (the run's
  logs directory: pid, process group, port, owning job). Before launching, a job stops any
  server whose lease names a dead owner, and says so in its log.

The jobs of a sharded phase (the hidden-state shards) share one server instead
(SharedServer): the first job launches it, the others attach, and its supervisor stops it
once no job has used it for the linger time (common.shared). Every launch, shared or not,
is one line of `<log dir>/servers/loads.jsonl`: the verifier loads a run took.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

import httpx2 as httpx

from workflow_scripts.common.atomic import write_json
from workflow_scripts.common.config import typed
from workflow_scripts.common.gpus import assign_job_gpus
from workflow_scripts.common.loads import record_load
from workflow_scripts.common.process import group_alive, group_members, kill_group, package_env, start_time
from workflow_scripts.common.shared import LEASE_NAME, SharedDir, process_alive
from workflow_scripts.common.verifier_config import (
    is_mla,
    read_text_config,
    safetensors_weight_map,
    vllm_serving_problems,
)
from workflow_scripts.common.vllm_cpu import cpu_has_amx, draft_backend_problem, vllm_cpu_installed

log = logging.getLogger(__name__)


class ServerError(RuntimeError):
    """vLLM died or never became healthy. The message carries the tail of its log."""


@dataclass(frozen=True)
class ServerConfig:
    """The `server` config section (config/README.md): how eagleflow launches vLLM, or the
    endpoint it uses instead."""

    endpoint: str | list[str] | None
    api_key_env: str | None
    served_model_name: str
    command: tuple[str, ...] | None
    host: str
    dtype: str
    max_model_len: int
    tensor_parallel_size: int
    gpus: int
    enforce_eager: bool
    reasoning_parser: str | None
    extra_args: tuple[str, ...]
    env: dict[str, str]
    startup_timeout_s: float
    max_restarts: int
    endpoint_wait_s: float

    @classmethod
    def from_section(cls, section: dict[str, Any]) -> ServerConfig:
        return typed(cls, section, "server")


@dataclass(frozen=True)
class ServerSpec:
    """Everything that decides how one vLLM process is started (ServerSpec.from_config for a
    model served as the `server` section says)."""

    name: ClassVar[str] = "vLLM"  # what the log calls it
    model: str
    served_model_name: str
    host: str
    dtype: str
    max_model_len: int | None
    tensor_parallel_size: int
    enforce_eager: bool
    reasoning_parser: str | None
    extra_args: Sequence[str]
    env: dict[str, str]
    startup_timeout_s: float
    launcher: Sequence[str] | None = None  # server.command: argv before vLLM's flags
    port: int | None = None  # None: pick a free port
    speculative_config: dict | None = None  # set by the benchmark
    stop_grace_s: float = 20.0  # SIGTERM first; SIGKILL whatever is left after this long

    @classmethod
    def from_config(cls, server: ServerConfig, model: str, **overrides: Any) -> ServerSpec:
        """The spec of a vLLM serving `model` as the `server` section says."""
        spec = cls(
            model=model,
            served_model_name=server.served_model_name,
            host=server.host,
            dtype=server.dtype,
            max_model_len=server.max_model_len,
            tensor_parallel_size=server.tensor_parallel_size,
            enforce_eager=server.enforce_eager,
            reasoning_parser=server.reasoning_parser,
            extra_args=server.extra_args,
            env=dict(server.env),
            startup_timeout_s=server.startup_timeout_s,
            launcher=server.command,
        )
        return dataclasses.replace(spec, **overrides) if overrides else spec

    def command(self, port: int) -> list[str]:
        # `python -m` because the `vllm` console script fails under the vllm-cpu
        # distribution (it looks up metadata of a distribution named `vllm`).
        launcher = list(self.launcher or [sys.executable, "-m", "vllm.entrypoints.openai.api_server"])
        cmd = [
            *launcher,
            "--model",
            self.model,
            "--served-model-name",
            self.served_model_name,
            "--host",
            self.host,
            "--port",
            str(port),
            "--dtype",
            self.dtype,
            "--tensor-parallel-size",
            str(self.tensor_parallel_size),
            "--disable-uvicorn-access-log",
        ]
        if self.max_model_len:
            cmd += ["--max-model-len", str(self.max_model_len)]
        if self.enforce_eager:
            cmd.append("--enforce-eager")
        if self.reasoning_parser:
            cmd += ["--reasoning-parser", self.reasoning_parser]
        if self.speculative_config:
            cmd += ["--speculative-config", json.dumps(self.speculative_config)]
        cmd += list(self.extra_args)
        return cmd

    def check(self) -> None:
        """Refuse, before the launch, a model vLLM cannot serve as configured (an MLA
        verifier in float32, DeepSeek-V3 routing without `topk_method: noaux_tc`, a draft
        whose attention shares no block size with the verifier's on vllm-cpu)."""
        if not (Path(self.model) / "config.json").is_file():
            return  # a hub name: nothing here to read
        try:
            tensor_names = set(safetensors_weight_map(self.model))
        except FileNotFoundError:
            tensor_names = set()  # no safetensors (vLLM reports what it cannot load)
        vllm_cpu = self.launcher is None and vllm_cpu_installed()
        verifier = read_text_config(self.model)
        problems = vllm_serving_problems(verifier, self.dtype, tensor_names, self.extra_args, vllm_cpu=vllm_cpu)
        draft = (self.speculative_config or {}).get("model")
        if vllm_cpu and draft and (Path(draft) / "config.json").is_file():
            attention = "mla" if is_mla(read_text_config(draft)) else "llama"
            problem = draft_backend_problem(verifier, attention, self.extra_args, cpu_has_amx())
            problems += [f"the draft {draft}: {problem}"] if problem else []
        if problems:
            raise ServerError(f"vLLM cannot serve {self.model} as configured: " + "; ".join(problems))


class Launchable(Protocol):
    """What the launcher needs of a server: ServerSpec for vLLM, or another server with the
    same lifecycle (the hf backend's extraction server)."""

    name: ClassVar[str]
    model: str
    host: str
    env: dict[str, str]
    startup_timeout_s: float
    port: int | None
    stop_grace_s: float

    def command(self, port: int) -> list[str]: ...

    def check(self) -> None:
        """Raise ServerError, before any process starts, for a model this server cannot serve."""


def spec_key(spec: Launchable) -> str:
    """A short digest of how a server is started (its command without the port, its env):
    jobs whose specs have the same key can share one server."""
    text = json.dumps([spec.command(0), sorted(spec.env.items())])
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return "(no log written)"
    return "\n".join(text[-lines:])


@dataclass(frozen=True)
class Lease:
    """Who launched a server, and how to find what is left of it."""

    pgid: int  # the supervisor's pid: the server's process group
    leader_started: int  # the supervisor's start time (a reused pid is another process)
    owner_pid: int  # the job process that launched it
    owner_started: int
    port: int
    model: str
    job: str  # the owning job's command line, for the log line that names it
    log: str

    @staticmethod
    def path(lease_dir: Path, pgid: int) -> Path:
        return lease_dir / LEASE_NAME.format(pgid=pgid)


def stop_leftover_servers(lease_dir: Path, grace_s: float) -> list[Lease]:
    """Stop every server under `lease_dir` whose owning job is gone; return their leases.

    A lease whose owner is alive belongs to a running job and is left alone. One whose group
    leader was replaced by an unrelated process (pid reuse) is only removed."""
    stopped = []
    for path in sorted(lease_dir.glob("vllm-*.json")):
        try:
            lease = Lease(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError) as e:
            log.warning("removing unreadable server lease %s (%s)", path, e)
            path.unlink(missing_ok=True)
            continue
        if start_time(lease.owner_pid) == lease.owner_started:
            continue
        leader = start_time(lease.pgid)
        members = group_members(lease.pgid) if leader in (None, lease.leader_started) else []
        if members:
            log.warning(
                "stopping a vLLM server left behind by a dead job: process group %d (%d processes), port %d, "
                "model %s, launched by pid %d (%s); log %s; lease %s",
                lease.pgid,
                len(members),
                lease.port,
                lease.model,
                lease.owner_pid,
                lease.job,
                lease.log,
                path,
            )
            kill_group(lease.pgid, grace_s)
            stopped.append(lease)
        path.unlink(missing_ok=True)
    return stopped


def describe_gpu_holders(gpus_csv: str, apps_csv: str, visible: str | None) -> list[str]:
    """Processes on the GPUs this job may use, one line each. Pure.

    `gpus_csv`: `nvidia-smi --query-gpu=index,uuid --format=csv,noheader`;
    `apps_csv`: `nvidia-smi --query-compute-apps=gpu_uuid,pid,process_name,used_memory
    --format=csv,noheader`; `visible`: CUDA_VISIBLE_DEVICES (indices or UUIDs; None: all)."""
    index_of = {}
    for line in gpus_csv.strip().splitlines():
        index, uuid = (x.strip() for x in line.split(",", 1))
        index_of[uuid] = index
    wanted = None if visible is None else {v.strip() for v in visible.split(",") if v.strip()}
    lines = []
    for line in apps_csv.strip().splitlines():
        uuid, pid, name, memory = (x.strip() for x in line.split(",", 3))
        index = index_of.get(uuid, "?")
        if wanted is None or index in wanted or uuid in wanted:
            lines.append(f"GPU {index}: pid {pid} ({name}) holds {memory}")
    return lines


def gpu_holders() -> list[str]:
    """describe_gpu_holders for this host and job; empty without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        query = ["nvidia-smi", "--format=csv,noheader"]
        gpus = subprocess.run([*query, "--query-gpu=index,uuid"], capture_output=True, text=True, timeout=30)
        apps = subprocess.run(
            [*query, "--query-compute-apps=gpu_uuid,pid,process_name,used_memory"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return [f"(nvidia-smi failed: {e})"]
    return describe_gpu_holders(gpus.stdout, apps.stdout, os.environ.get("CUDA_VISIBLE_DEVICES"))


class VllmServer:
    """A running vLLM server. Use as a context manager: the process group dies on exit.

    `lease_dir` (default: `servers/` next to the log) holds the leases of a run's servers."""

    def __init__(self, spec: Launchable, log_path: str | os.PathLike, lease_dir: str | os.PathLike | None = None):
        self.spec = spec
        self.log_path = Path(log_path)
        self.lease_dir = Path(lease_dir) if lease_dir else self.log_path.parent / "servers"
        self.port = spec.port or free_port(spec.host)
        self.proc: subprocess.Popen | None = None
        self.gpu_holders: list[str] = []

    @property
    def base_url(self) -> str:
        return f"http://{self.spec.host}:{self.port}"

    def start(self) -> None:
        self.launch()
        self.wait_healthy()

    def launch(
        self, shared: SharedDir | None = None, linger_s: float = 0.0, pass_fds: Sequence[int] = (), kind: str = "start"
    ) -> None:
        """Start the process group (not waiting for health). Call it from a thread that
        outlives the server: Linux sends the parent-death signal when the *thread* that
        started a process exits, so a server launched from a pool's worker thread would be
        stopped by its supervisor when that thread retires.

        With `shared`, the server outlives this job: its supervisor follows the consumers
        registered there, and `pass_fds` (this job's GPU locks) stay held by it."""
        self.spec.check()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.lease_dir.mkdir(parents=True, exist_ok=True)
        stop_leftover_servers(self.lease_dir, self.spec.stop_grace_s)
        self.gpu_holders = gpu_holders()
        if self.gpu_holders:
            log.warning("the GPUs of this job are in use before vLLM starts:\n  %s", "\n  ".join(self.gpu_holders))
        cmd = self.spec.command(self.port)
        owner = ["--shared", str(shared.path), "--linger", str(linger_s)] if shared else ["--parent", str(os.getpid())]
        supervised = [
            sys.executable,
            "-m",
            "workflow_scripts.common.supervise",
            *owner,
            "--grace",
            str(self.spec.stop_grace_s),
            "--",
            *cmd,
        ]
        env = package_env({**os.environ, **{k: str(v) for k, v in self.spec.env.items()}})
        log.info("starting %s on %s (log: %s): %s", self.spec.name, self.base_url, self.log_path, " ".join(cmd))
        with open(self.log_path, "ab") as logfile:
            self.proc = subprocess.Popen(
                supervised,
                stdout=logfile,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
                pass_fds=tuple(pass_fds),
            )
        self._write_lease(shared is not None)
        record_load(self.lease_dir, self.log_path, self.spec.model, kind, shared is not None)

    def _write_lease(self, shared: bool) -> None:
        assert self.proc is not None
        # A shared server's owner is its own supervisor: it outlives the job that launched it.
        owner = self.proc.pid if shared else os.getpid()
        lease = Lease(
            pgid=self.proc.pid,
            leader_started=start_time(self.proc.pid) or 0,
            owner_pid=owner,
            owner_started=start_time(owner) or 0,
            port=self.port,
            model=self.spec.model,
            job=" ".join(sys.argv)[:500],
            log=str(self.log_path),
        )
        write_json(Lease.path(self.lease_dir, lease.pgid), dataclasses.asdict(lease))

    def _failure(self, what: str) -> ServerError:
        held = (
            "\nProcesses holding this job's GPUs before the start (not vLLM's own memory):\n  "
            + "\n  ".join(self.gpu_holders)
            if self.gpu_holders
            else ""
        )
        return ServerError(f"{what}. Last lines of {self.log_path}:\n{tail(self.log_path)}{held}")

    def wait_healthy(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.spec.startup_timeout_s
        started = time.monotonic()
        with httpx.Client(timeout=5.0) as client:
            while True:
                code = self.proc.poll()
                if code is not None:
                    raise self._failure(
                        f"{self.spec.name} exited with code {code} before becoming healthy (model {self.spec.model})"
                    )
                try:
                    if client.get(f"{self.base_url}/health").status_code == 200:
                        log.info("%s healthy after %.0f s", self.spec.name, time.monotonic() - started)
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise self._failure(
                        f"{self.spec.name} did not answer {self.base_url}/health within "
                        f"{self.spec.startup_timeout_s:.0f} s (server.startup_timeout_s)"
                    )
                time.sleep(1.0)

    def stop(self) -> None:
        """Stop the whole process group: SIGTERM, then SIGKILL after `spec.stop_grace_s`."""
        if self.proc is None:
            return
        kill_group(self.proc.pid, self.spec.stop_grace_s)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        Lease.path(self.lease_dir, self.proc.pid).unlink(missing_ok=True)
        self.proc = None

    def exit_status(self) -> int | None:
        """The launched server's exit status (the supervisor's: vLLM's, 128 + n after signal
        n), or None while it runs."""
        return self.proc.poll() if self.proc is not None else None

    def __enter__(self) -> VllmServer:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def describe_exit(status: int) -> str:
    if status > 128 and status - 128 in signal.Signals._value2member_map_:
        return f"killed by {signal.Signals(status - 128).name}"
    return f"exit status {status}"


async def _health(url: str) -> int | None:
    """The status of GET `url`/health, or None when nothing answers."""
    try:
        async with httpx.AsyncClient(timeout=5.0) as client:
            return (await client.get(f"{url.rstrip('/')}/health")).status_code
    except httpx.HTTPError:
        return None


async def answers(url: str) -> bool:
    """Whether anything listens at `url`: any HTTP reply to GET /health (an OpenAI-compatible
    server without that route answers 404) counts; a refused or dropped connection does not."""
    return await _health(url) is not None


async def healthy(url: str) -> bool:
    """Whether vLLM at `url` says it is healthy (its /health is 500 once its engine died)."""
    return await _health(url) == 200


class Recovery:
    """What a client does when its server stops answering: `recover` returns True when the
    server is back (the failed request is retried without spending an attempt), False when
    the server is fine (the failure was the request's own: the retry policy goes on), or
    raises ServerError when it gives up."""

    restarts = 0  # servers this job started again

    async def recover(self, url: str, cause: str) -> bool:
        raise NotImplementedError


class RestartDeadServer(Recovery):
    """For a server this job launched: when it died (or lives on without a healthy engine:
    /health is not 200), start it again, at most `max_restarts` times per job. The requests
    in flight are sent again; nothing stored is lost."""

    def __init__(self, server: VllmServer, max_restarts: int):
        self.server = server
        self.max_restarts = max_restarts
        self._lock = asyncio.Lock()

    async def recover(self, url: str, cause: str) -> bool:
        restarts = self.restarts
        async with self._lock:
            if self.restarts != restarts:
                return True  # restarted while this request waited for the lock
            trouble = await self._trouble(url)
            if trouble is None:
                return False
            what = f"{self.server.spec.name} ({self.server.spec.model}) {trouble}"
            if self.restarts >= self.max_restarts:
                raise self.server._failure(
                    f"{what}, after {self.restarts} restart(s) in this job (server.max_restarts: {self.max_restarts})"
                )
            self.restarts += 1
            log.warning(
                "%s (a request saw: %s). Restart %d of %d; last lines of %s:\n%s",
                what,
                cause,
                self.restarts,
                self.max_restarts,
                self.server.log_path,
                tail(self.server.log_path, 20),
            )
            # Again on the same port, so clients keep their URL. The launch runs in this thread,
            # the event loop's, which lives as long as the job (see VllmServer.launch).
            await asyncio.to_thread(self.server.stop)
            self.server.launch(kind="restart")
            await asyncio.to_thread(self.server.wait_healthy)
            return True

    async def _trouble(self, url: str) -> str | None:
        """None while /health answers 200; what is wrong once the server has exited, or has
        not answered 200 for the stop grace period and 10 s (a dropped connection can come a
        moment before the supervisor has stopped the group and exited)."""
        deadline = time.monotonic() + self.server.spec.stop_grace_s + 10
        while True:
            status = self.server.exit_status()
            if status is not None:
                return f"died while serving ({describe_exit(status)})"
            if await healthy(url):
                return None
            if time.monotonic() > deadline:
                return f"runs, but its /health has not answered 200 for {self.server.spec.stop_grace_s + 10:.0f} s"
            await asyncio.sleep(0.5)


class WaitForEndpoint(Recovery):
    """For a server this job did not start (`server.endpoint`): wait for it to answer again,
    at most `budget_s` in all for the job (server.endpoint_wait_s)."""

    def __init__(self, budget_s: float):
        self.budget_s = budget_s
        self.waited_s = 0.0
        self._lock = asyncio.Lock()

    async def recover(self, url: str, cause: str) -> bool:
        async with self._lock:
            if await answers(url):
                return False
            log.warning("the server at %s does not answer (%s): waiting for it (server.endpoint_wait_s)", url, cause)
            while self.waited_s < self.budget_s:
                started = time.monotonic()
                await asyncio.sleep(min(5.0, self.budget_s - self.waited_s))
                back = await answers(url)
                self.waited_s += time.monotonic() - started
                if back:
                    log.warning("the server at %s answers again; %.0f s of waiting spent", url, self.waited_s)
                    return True
            raise ServerError(
                f"the server at {url} has not answered for {self.waited_s:.0f} s in this job "
                f"(server.endpoint_wait_s: {self.budget_s:g}); last error: {cause}"
            )


@dataclass(frozen=True)
class Served:
    """Where requests go (one URL, or several replicas), and what to do when the server
    behind them stops answering."""

    url: str | list[str]
    recovery: Recovery


@dataclass(frozen=True)
class Sharing:
    """How the jobs of a phase share one server: `name` the phase (its log is
    `<log dir>/<name>.server.log`), `linger_s` how long the server waits for the next job,
    `gpus` how many the server takes (claimed by the job that launches it)."""

    name: str
    linger_s: float
    gpus: int = 0


class SharedServer:
    """One server for every job of a phase. The first job launches it; later jobs (and jobs
    running at the same time) attach to it; it stops once no job has used it for
    `sharing.linger_s` (or when `stop_idle_shared_servers` ends the phase). Jobs whose spec
    differs (another model, other layers, other flags) get their own. Use as a context
    manager: entering registers this job and waits until the server is healthy (a server
    still loading is waited for up to its startup timeout, counted from its launch)."""

    def __init__(self, spec: Launchable, sharing: Sharing, lease_dir: str | os.PathLike):
        self.spec = spec
        self.sharing = sharing
        self.lease_dir = Path(lease_dir)
        self.log_path = self.lease_dir.parent / f"{sharing.name}.server.log"
        # Per host: the jobs of one submission (or one machine) share it; the launch binds loopback.
        self.dir = SharedDir(self.lease_dir / f"shared-{sharing.name}-{spec_key(spec)}-{socket.gethostname()}")
        self.state: dict[str, Any] = {}
        self._consumer: Path | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.spec.host}:{self.state['port']}"

    def __enter__(self) -> SharedServer:
        self._consumer = self.dir.register(os.getpid(), " ".join(sys.argv)[:500])
        try:
            with self.dir.locked():
                state = self.dir.live_state()
                if state is None:
                    self.state = self._launch(port=None, kind="start")
                else:
                    self.state = state
                    log.info(
                        "using the phase's shared %s on %s: started by pid %d (%s); log %s",
                        self.spec.name,
                        self.base_url,
                        state["launched_by_pid"],
                        state["launched_by"],
                        state["log"],
                    )
            self.wait_healthy()
        except BaseException:
            self._leave()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._leave()

    def _leave(self) -> None:
        if self._consumer is not None:
            self._consumer.unlink(missing_ok=True)
            self._consumer = None

    def _launch(self, port: int | None, kind: str) -> dict[str, Any]:
        """Launch the server for the phase (the caller holds the lock)."""
        claim = assign_job_gpus(self.sharing.gpus)
        try:
            server = VllmServer(dataclasses.replace(self.spec, port=port), self.log_path, self.lease_dir)
            server.launch(
                shared=self.dir, linger_s=self.sharing.linger_s, pass_fds=claim.fds() if claim else (), kind=kind
            )
        finally:
            if claim is not None:
                claim.release()  # the supervisor holds the same locks for the server's life
        assert server.proc is not None
        state = {
            "pgid": server.proc.pid,
            "leader_started": start_time(server.proc.pid) or 0,
            "port": server.port,
            "model": self.spec.model,
            "log": str(self.log_path),
            "started_at": time.time(),
            "launched_by_pid": os.getpid(),
            "launched_by": " ".join(sys.argv)[:500],
            "stop_grace_s": self.spec.stop_grace_s,
        }
        self.dir.write_state(state)
        log.info("this job started the phase's shared %s; later jobs attach to it", self.spec.name)
        return state

    def alive(self) -> bool:
        return process_alive(self.state["pgid"], self.state["leader_started"])

    def describe_end(self) -> str:
        status = self.dir.read_exit(self.state["pgid"])
        return describe_exit(status) if status is not None else "ended"

    def wait_healthy(self) -> None:
        deadline = self.state["started_at"] + self.spec.startup_timeout_s
        started = time.monotonic()
        with httpx.Client(timeout=5.0) as client:
            while True:
                if not self.alive():
                    raise ServerError(
                        f"the shared {self.spec.name} ({self.spec.model}) {self.describe_end()} before becoming "
                        f"healthy. Last lines of {self.log_path}:\n{tail(self.log_path)}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{self.base_url}/health").status_code == 200:
                        log.info("%s healthy (waited %.0f s)", self.spec.name, time.monotonic() - started)
                        return
                if time.time() > deadline:
                    if self.state["launched_by_pid"] == os.getpid():
                        self.dir.clear_state(self.state["pgid"])
                        stop_shared(self.dir, self.state)
                    raise ServerError(
                        f"the shared {self.spec.name} did not answer {self.base_url}/health within "
                        f"{self.spec.startup_timeout_s:.0f} s of its start (server.startup_timeout_s). "
                        f"Last lines of {self.log_path}:\n{tail(self.log_path)}"
                    )
                time.sleep(1.0)

    def restart(self, seen_pgid: int) -> None:
        """Start the server again on its port, unless another job already did since this one
        saw group `seen_pgid` fail; then wait until it is healthy."""
        with self.dir.locked():
            state = self.dir.live_state()
            if state is not None and state["pgid"] != seen_pgid:
                self.state = state
            else:
                if state is not None:  # alive, but its engine is not: stop what is left of it
                    stop_shared(self.dir, state)
                self.state = self._launch(port=self.state["port"], kind="restart")
        self.wait_healthy()


class RestartSharedServer(Recovery):
    """RestartDeadServer for a shared server: whichever job sees it die first starts it
    again (under the shared lock); the others find the new one on the same port."""

    def __init__(self, server: SharedServer, max_restarts: int):
        self.server = server
        self.max_restarts = max_restarts
        self._lock = asyncio.Lock()

    async def recover(self, url: str, cause: str) -> bool:
        async with self._lock:
            seen = self.server.state["pgid"]
            trouble = await self._trouble(url)
            if trouble is None:
                return False
            what = f"the shared {self.server.spec.name} ({self.server.spec.model}) {trouble}"
            if self.restarts >= self.max_restarts:
                raise ServerError(
                    f"{what}, after {self.restarts} restart(s) in this job (server.max_restarts: "
                    f"{self.max_restarts}). Last lines of {self.server.log_path}:\n{tail(self.server.log_path)}"
                )
            self.restarts += 1
            log.warning(
                "%s (a request saw: %s). Restart %d of %d; last lines of %s:\n%s",
                what,
                cause,
                self.restarts,
                self.max_restarts,
                self.server.log_path,
                tail(self.server.log_path, 20),
            )
            await asyncio.to_thread(self.server.restart, seen)
            return True

    async def _trouble(self, url: str) -> str | None:
        grace = self.server.spec.stop_grace_s + 10
        deadline = time.monotonic() + grace
        while True:
            if not self.server.alive():
                return f"died while serving ({self.server.describe_end()})"
            if await healthy(url):
                return None
            if time.monotonic() > deadline:
                return f"runs, but its /health has not answered 200 for {grace:.0f} s"
            await asyncio.sleep(0.5)


def stop_idle_shared_servers(lease_dir: str | os.PathLike, name: str) -> int:
    """Stop the shared servers of phase `name` that no job uses (the phase is over: the
    GPUs are free for the next one at once, not after the linger time). Returns how many."""
    stopped = 0
    for path in sorted(Path(lease_dir).glob(f"shared-{name}-*")):
        shared = SharedDir(path)
        with shared.locked():
            state = shared.live_state()
            if state is None or shared.live_consumers():
                continue
            log.info("stopping the shared server of %s (process group %d): the phase is over", name, state["pgid"])
            shared.clear_state(state["pgid"])
            stop_shared(shared, state)
            stopped += 1
    return stopped


def stop_shared(shared: SharedDir, state: dict[str, Any]) -> None:
    """Stop a shared server: ask its supervisor (SIGTERM), which stops the group and drops
    the lease; SIGKILL the group only if that has not happened after the grace period."""
    pgid, grace = state["pgid"], state["stop_grace_s"]
    with contextlib.suppress(ProcessLookupError):
        os.kill(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace + 10
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if group_alive(pgid):
        kill_group(pgid, 0)
        (shared.path.parent / LEASE_NAME.format(pgid=pgid)).unlink(missing_ok=True)


@contextlib.contextmanager
def serve(
    spec: Launchable,
    log_path: str | os.PathLike,
    config: ServerConfig,
    endpoint: str | list[str] | None,
    sharing: Sharing | None = None,
) -> Iterator[Served]:
    """The running server(s) at `endpoint` (`server.endpoint`, or a stage's own), or a fresh
    server launched as `spec` says and stopped on exit, or with `sharing` the phase's shared
    one (launched by whichever job comes first); each with the recovery that the `server`
    section (`config`) asks for."""
    if endpoint:
        log.info("using the already running server(s) at %s", endpoint)
        yield Served(endpoint, WaitForEndpoint(config.endpoint_wait_s))
        return
    if sharing is not None:
        with SharedServer(spec, sharing, Path(log_path).parent / "servers") as shared:
            yield Served(shared.base_url, RestartSharedServer(shared, config.max_restarts))
        return
    with VllmServer(spec, log_path) as server:
        yield Served(server.base_url, RestartDeadServer(server, config.max_restarts))
