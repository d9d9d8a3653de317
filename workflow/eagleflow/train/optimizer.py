"""The draft's optimizer (`train.optimizer`): AdamW on every trainable tensor, or Muon on the
draft's hidden weight matrices with AdamW on the rest, as speculators' trainer does by default.

Muon orthogonalises each update of a 2D matrix (Newton-Schulz iterations); embedding-like and
output matrices (`lm_head`) and every vector stay with AdamW, the usual Muon practice and
speculators' split. Both take the loop's learning rate: with "match_rms_adamw" Muon scales its
update to AdamW's RMS, so one schedule drives both (BENCHMARKS.md, "eagleflow's trainer against
speculators'": at the demo's step count Muon is what the peer's recipe gains on).
"""

from __future__ import annotations

from typing import Any

import torch

ADAMW_BETAS = (0.9, 0.95)
# torch.optim.Muon's settings as speculators 0.9 passes them by default.
MUON_MOMENTUM = 0.95
MUON_WEIGHT_DECAY = 0.1
MUON_NS_STEPS = 5
MUON_ADJUST_LR = "match_rms_adamw"
# Matrices that stay with AdamW though 2D: the vocabulary's rows.
ADAMW_NAMES = ("embed_tokens", "lm_head")


def takes_muon(name: str, param: torch.Tensor) -> bool:
    """Whether Muon updates this trainable tensor: a true matrix, not a vocabulary's. Pure."""
    return param.ndim == 2 and min(param.shape) > 1 and not any(hint in name for hint in ADAMW_NAMES)


class Optimizers:
    """Several optimizers stepped as one: the loop sets the learning rate on `param_groups`,
    steps, zeroes and checkpoints one object. Each inner optimizer owns its groups and state."""

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

    def state_dict(self) -> dict[str, Any]:
        return {str(i): opt.state_dict() for i, opt in enumerate(self.optimizers)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if sorted(state_dict) != [str(i) for i in range(len(self.optimizers))]:
            raise ValueError("the checkpoint's optimizer state is another train.optimizer's")
        for i, opt in enumerate(self.optimizers):
            opt.load_state_dict(state_dict[str(i)])


def build_optimizer(
    model: torch.nn.Module, kind: str, lr: float, weight_decay: float
) -> torch.optim.Optimizer | Optimizers:
    """The optimizer of `model`'s trainable tensors: `kind` "adamw" or "muon" (train.optimizer)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if kind == "adamw":
        return torch.optim.AdamW([p for _, p in named], lr=lr, betas=ADAMW_BETAS, weight_decay=weight_decay)
    if kind != "muon":
        raise ValueError(f"train.optimizer: {kind!r} is neither adamw nor muon")
    matrices = [p for n, p in named if takes_muon(n, p)]
    rest = [p for n, p in named if not takes_muon(n, p)]
    muon = torch.optim.Muon(
        matrices,
        lr=lr,
        momentum=MUON_MOMENTUM,
        weight_decay=MUON_WEIGHT_DECAY,
        ns_steps=MUON_NS_STEPS,
        adjust_lr_fn=MUON_ADJUST_LR,
    )
    return Optimizers([muon, torch.optim.AdamW(rest, lr=lr, betas=ADAMW_BETAS, weight_decay=weight_decay)])
