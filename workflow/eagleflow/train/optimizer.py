"""The draft's optimizer (`train.optimizer`): AdamW on every trainable tensor, or Muon on the
draft's hidden weight matrices with AdamW on the rest, as speculators' trainer does by default.

Muon orthogonalises each update of a 2D matrix (Newton-Schulz iterations); embedding-like and
output matrices (`lm_head`) and every vector stay with AdamW, the usual Muon practice and
speculators' split. Both take the loop's learning rate: with "match_rms_adamw" Muon scales its
update to AdamW's RMS, so one schedule drives both (docs/results, "The peer at eagleflow's step
count": at the demo's step count Muon is what the peer's recipe gains on).

torch's Muon runs its Newton-Schulz iterations in bfloat16. On a GPU that is its design; on a
CPU without bf16 units a bfloat16 matmul takes a reference path (36x float32's time on AVX2:
24 s a demo step instead of 1.1 s), and where the CPU has them the draft's bytes would depend
on the CPU that trained it. On a CPU the iterations run in float32 (CpuMuon), the same update
otherwise.
"""

from __future__ import annotations

import math
from typing import Any

import torch

ADAMW_BETAS = (0.9, 0.95)
# torch.optim.Muon's settings as speculators 0.9 passes them by default.
MUON_MOMENTUM = 0.95
MUON_WEIGHT_DECAY = 0.1
MUON_NS_STEPS = 5
MUON_ADJUST_LR = "match_rms_adamw"
# Matrices that stay with AdamW though 2D: the vocabulary's rows.
ADAMW_NAMES = ("embed_tokens", "lm_head", "codebook")  # codebook: DFlash2's selector


def takes_muon(name: str, param: torch.Tensor) -> bool:
    """Whether Muon updates this trainable tensor: a true matrix, not a vocabulary's. Pure."""
    return param.ndim == 2 and min(param.shape) > 1 and not any(hint in name for hint in ADAMW_NAMES)


class Optimizers:
    """Several optimizers stepped as one: the loop sets the learning rate on `param_groups`,
    steps and zeroes one object; a checkpoint holds each inner optimizer's state
    (train.checkpoint, torch's state-dict functions over `optimizers`)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        # Read through each time: load_state_dict gives an optimizer new group dicts.
        return [group for opt in self.optimizers for group in opt.param_groups]

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)


def orthogonalize(update: torch.Tensor, ns_coefficients: tuple[float, float, float], steps: int, eps: float):
    """Muon's quintic Newton-Schulz iteration towards the nearest semi-orthogonal matrix of a 2D
    `update`, in float32: torch.optim.Muon's iteration (same coefficients, normalisation and
    transpose of a tall matrix) without its cast to bfloat16. Pure."""
    a, b, c = ns_coefficients
    tall = update.size(0) > update.size(1)
    x = update.float()
    x = x.T if tall else x
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


class CpuMuon(torch.optim.Muon):
    """torch.optim.Muon with its Newton-Schulz iterations in float32 (`orthogonalize`), for a
    draft on a CPU. The same groups, state (`momentum_buffer`) and update as torch's: a
    checkpoint moves between the two."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(param.grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(param.grad, 1 - momentum)
                update = param.grad.lerp(buf, momentum) if group["nesterov"] else buf
                update = orthogonalize(update, group["ns_coefficients"], group["ns_steps"], group["eps"])
                param.mul_(1 - lr * group["weight_decay"])
                param.add_(update.to(param.dtype), alpha=-adjusted_lr(lr, group["adjust_lr_fn"], param.shape))
        return loss


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """Muon's learning rate for a matrix of `shape`, as torch.optim.Muon adjusts it. Pure."""
    rows, cols = shape[:2]
    if adjust_lr_fn in (None, "original"):
        return lr * math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


def build_optimizer(
    model: torch.nn.Module, kind: str, lr: float, weight_decay: float
) -> torch.optim.Optimizer | Optimizers:
    """The optimizer of `model`'s trainable tensors: `kind` "adamw" or "muon" (train.optimizer).
    Muon's iterations run in bfloat16 on an accelerator (torch's), in float32 on a CPU."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if kind == "adamw":
        return torch.optim.AdamW([p for _, p in named], lr=lr, betas=ADAMW_BETAS, weight_decay=weight_decay)
    if kind != "muon":
        raise ValueError(f"train.optimizer: {kind!r} is neither adamw nor muon")
    matrices = [p for n, p in named if takes_muon(n, p)]
    rest = [p for n, p in named if not takes_muon(n, p)]
    on_cpu = all(p.device.type == "cpu" for p in matrices)
    muon = (CpuMuon if on_cpu else torch.optim.Muon)(
        matrices,
        lr=lr,
        momentum=MUON_MOMENTUM,
        weight_decay=MUON_WEIGHT_DECAY,
        ns_steps=MUON_NS_STEPS,
        adjust_lr_fn=MUON_ADJUST_LR,
    )
    return Optimizers([muon, torch.optim.AdamW(rest, lr=lr, betas=ADAMW_BETAS, weight_decay=weight_decay)])
