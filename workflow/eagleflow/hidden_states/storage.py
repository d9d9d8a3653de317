"""How states are stored in a shard, and what that costs per token (the disk check and the
plan both count with it). Pure. Imports no extraction code, so that the training stage reads
shards without it, and torch only where tensors are made, so that the plan (which every
`snakemake` start imports) stays light."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Dtypes the verifier computes in and the backends hand states over in.
COMPUTE_DTYPES = ("bfloat16", "float16", "float32")
# Storage dtypes of the states (`hidden_states.dtype`) and their bytes per value. fp8 is
# e4m3 with one float32 scale per token and state (per-token scales: a state's amax sets its
# scale, so one outlier token costs no other token precision); the backends hand states over
# in bfloat16 and the shard job quantizes them (quantize_fp8).
FP8 = "float8_e4m3fn"
STORAGE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, FP8: 1}
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
SCALE_BYTES = 4
# Per token besides the states: the token id (int32) and the loss mask (int8).
TOKEN_BYTES = 4 + 1
# The compact target (`hidden_states.target: topk`) stores, instead of the final state, the
# verifier's k largest logits per token: a verifier-vocabulary id (int32) and the logit less
# the token's largest (float16, <= 0) for each.
TOPK_ENTRY_BYTES = 4 + 2
# Per sample: its offset (int64), its split (bool) and its id in the header (JSON, ~30 bytes).
SAMPLE_BYTES = 8 + 1 + 32


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a config name (`bfloat16`, `float8_e4m3fn`, ...)."""
    import torch

    return getattr(torch, name)


def extraction_dtype(storage: str) -> str:
    """The dtype the backends hand states over in for storage dtype `storage`. Pure."""
    return "bfloat16" if storage == FP8 else storage


def target_topk(target: str, topk: int) -> int:
    """Logits a shard keeps per token instead of the final state (`hidden_states.target` and
    `.topk`); 0: it keeps the state. Pure."""
    return topk if target == "topk" else 0


def num_stored_states(num_aux: int, topk: int) -> int:
    """How many full states a shard stores per token: the aux states, and the final state
    unless the compact target (`topk` > 0) replaces it. Pure."""
    return num_aux + (0 if topk else 1)


def token_bytes(num_states: int, hidden_size: int, storage: str, topk: int = 0) -> int:
    """Bytes a shard holds per token for `num_states` states of `hidden_size`: the states, fp8's
    scales, the compact target's `topk` entries, the token id and the loss mask. Pure."""
    states = num_states * hidden_size * STORAGE_BYTES[storage]
    scales = num_states * SCALE_BYTES if storage == FP8 else 0
    return states + scales + topk * TOPK_ENTRY_BYTES + TOKEN_BYTES


def shard_bytes(
    num_tokens: int, num_samples: int, num_states: int, hidden_size: int, storage: str, topk: int = 0
) -> int:
    """What a shard of `num_tokens` tokens in `num_samples` samples takes on disk, give or
    take the safetensors header's fixed part. Pure."""
    return num_tokens * token_bytes(num_states, hidden_size, storage, topk) + num_samples * SAMPLE_BYTES


def quantize_fp8(states: torch.Tensor, num_states: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 states [tokens, num_states * hidden], float32 scales [tokens, num_states]): each
    token's state is divided by its own amax / 448. Pure."""
    import torch

    n = states.shape[0]
    x = states.float().reshape(n, num_states, -1)
    scale = x.abs().amax(dim=-1).clamp(min=torch.finfo(torch.float32).tiny) / FP8_MAX
    return (x / scale.unsqueeze(-1)).to(torch.float8_e4m3fn).reshape(n, -1), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """quantize_fp8's inverse, up to e4m3's rounding. Pure."""
    n, k = scale.shape
    return (q.float().reshape(n, k, -1) * scale.unsqueeze(-1)).reshape(n, -1).to(dtype)


def stored_states(tensors: dict[str, torch.Tensor], name: str, dtype: torch.dtype) -> torch.Tensor:
    """States `name` of a shard's tensors in `dtype`, dequantized when stored in fp8 (a
    `<name>_scale` tensor next to them). Pure."""
    scale = tensors.get(f"{name}_scale")
    return tensors[name].to(dtype) if scale is None else dequantize_fp8(tensors[name], scale, dtype)


def as_read_back(states: torch.Tensor, num_states: int, dtype: str) -> torch.Tensor:
    """`states` (a backend's, in the extraction dtype) as training reads them back from a shard
    stored in `dtype`: float32, through fp8 when stored so. Always a copy (a forward in
    inference mode makes tensors autograd cannot save). Pure."""
    import torch

    if dtype == FP8:
        return dequantize_fp8(*quantize_fp8(states, num_states), torch.float32)
    return states.to(torch.float32, copy=True)
