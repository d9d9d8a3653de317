"""How a server is started: the `server` config section (ServerConfig), vLLM's argv for one
model (ServerSpec) and the checks that refuse a model before its launch. Run-only: what of
the argv changes a result reaches the result keys as data (runtime.server_args.result_args)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

from eagleflow.common.config import typed
from eagleflow.common.verifier_config import (
    is_mla,
    read_text_config,
    safetensors_weight_map,
    vllm_serving_problems,
)
from eagleflow.runtime import vllm_cpu_entry
from eagleflow.runtime.vllm_cpu import (
    cpu_has_amx,
    draft_backend_problem,
    seeded_sampling_args,
    vllm_cpu_installed,
)

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
    # Without a launcher: the module this interpreter runs (`python -m`), vLLM's OpenAI server
    # (on vllm-cpu through runtime/vllm_cpu_entry.py) or a stage's wrapper of it (the
    # benchmark's, benchmark/vllm_serve.py).
    entry_module: str = vllm_cpu_entry.SERVER_MODULE
    port: int | None = None  # None: pick a free port
    speculative_config: dict | None = None  # set by the benchmark
    stop_grace_s: float = 20.0  # SIGTERM first; SIGKILL whatever is left after this long
    # Directories only this server writes (the extraction's per-request files): removed when
    # it is stopped, so that what a killed client never read does not outlive the server.
    scratch_dirs: tuple[str, ...] = ()
    # Set by the stages whose requests sample with a seed (generate, write_prompts at a
    # temperature above 0): a vllm-cpu launch then turns chunked prefill off (vllm_cpu.py).
    seeded_sampling: bool = False
    # The argv before the whole command: `srun ...` for a server on another node of the job
    # (runtime.slurm_nodes), whose `host` is then that node's address.
    wrapper: tuple[str, ...] = ()

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
        launcher = list(self.launcher or [sys.executable, "-m", self.launched_module()])
        cmd = [
            *self.wrapper,
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
        cmd += list(self.launch_extra_args())
        return cmd

    def launched_module(self) -> str:
        """The module `python -m` runs: vLLM's server through vllm_cpu_entry on vllm-cpu (its
        engine core forked: less than half the start), else entry_module as it is."""
        if self.entry_module == vllm_cpu_entry.SERVER_MODULE and vllm_cpu_installed():
            return vllm_cpu_entry.__name__
        return self.entry_module

    def launch_extra_args(self) -> tuple[str, ...]:
        """`extra_args` as launched: with vllm-cpu's seeded-sampling workaround where it applies."""
        if self.seeded_sampling and self.launcher is None and vllm_cpu_installed():
            return seeded_sampling_args(self.extra_args)
        return tuple(self.extra_args)

    def check(self) -> None:
        """Refuse, before the launch, a model vLLM cannot serve as configured (an MLA
        verifier in float32, DeepSeek-V3 routing without `topk_method: noaux_tc`, a draft
        whose attention shares no block size with the verifier's on vllm-cpu)."""
        if added := [a for a in self.launch_extra_args() if a not in self.extra_args]:
            log.info(
                "vllm-cpu with seeded sampling: launched with %s (a split prefill of a seeded request "
                "kills vllm-cpu 0.32's engine; docs/facts.md)",
                " ".join(added),
            )
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
    scratch_dirs: tuple[str, ...]

    def command(self, port: int) -> list[str]: ...

    def check(self) -> None:
        """Raise ServerError, before any process starts, for a model this server cannot serve."""


def spec_key(spec: Launchable) -> str:
    """A short digest of how a server is started (its command without the port, its env):
    jobs whose specs have the same key can share one server."""
    text = json.dumps([spec.command(0), sorted(spec.env.items())])
    return hashlib.sha256(text.encode()).hexdigest()[:12]
