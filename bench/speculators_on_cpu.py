"""speculators' own trainer on a machine without an accelerator: a benchmark-side adapter.

    .venv/bin/python bench/speculators_on_cpu.py SPECULATORS-TRAIN-ARGS...

Takes the arguments of `speculators train` and runs speculators' training entry point in this
process with the CPU standing in for the accelerator it asks for. Not part of the workflow:
`bench/peer_draft.py` uses it to put the peer's trainer beside eagleflow's on the same data on
the project's CPU machines. On a machine with an accelerator it changes nothing and runs
`speculators train` as it is.

speculators 0.9.0 asks `torch.accelerator` for its device and moves the draft and every
batch to `get_local_rank()` (device index 0, which torch reads as `cuda:0`). The adapter
answers those calls with the CPU:

- `torch.accelerator.is_available`, `current_accelerator`, `current_device_index`,
  `set_device_index`, `synchronize`, `memory_allocated`: the CPU, index 0, no-ops, 0 bytes;
- the trainer's and the recovery's `get_local_rank`: `torch.device("cpu")`, so that
  `model.to(...)` and the batches' `.to(...)` stay on the CPU and autocast runs as
  `torch.autocast("cpu", ...)`;
- its dataloaders are built with `pin_memory=False` (pinning asks for the accelerator).

- torch's Muon, which speculators builds by default: eagleflow's CpuMuon, the same update with
  its Newton-Schulz iterations in float32 (a CPU computes in float32 only: torch's run in
  bfloat16, a reference path on a CPU without bf16 units).

Otherwise the trainer's arithmetic is speculators' own: its loss, optimizer, schedule, sampler
and checkpoints. On a CPU pass `--loss-implementation eager` (the fused loss is a Triton
kernel), `--draft-attn-impl sdpa` (flex attention needs a compiler for the device),
`--num-workers 0` (the dataloader's workers would each import the stack again),
`--hidden-states-dtype float32` (its bfloat16 default makes a DFlash step 147 s instead of 11 s
on AVX2), and `--save-best` to keep only the checkpoint of the lowest validation loss;
`bench/peer_draft.py` does (the last epoch's instead with its `--checkpoint last`).
"""

from __future__ import annotations

import sys

import torch

from eagleflow.train.optimizer import CpuMuon

CPU = torch.device("cpu")


def hand_the_cpu() -> None:
    """Answer speculators' accelerator calls with the CPU (see the module's docstring)."""
    accelerator = torch.accelerator
    accelerator.is_available = lambda: True
    accelerator.current_accelerator = lambda check_available=False: CPU
    accelerator.current_device_index = lambda: 0
    accelerator.set_device_index = lambda index: None
    accelerator.synchronize = lambda device=None: None
    accelerator.memory_allocated = lambda device=None: 0
    if not hasattr(torch.cpu, "empty_cache"):
        torch.cpu.empty_cache = lambda: None

    from speculators.train import dataloader, recovery, trainer

    class UnpinnedLoader(dataloader.DataLoader):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **{**kwargs, "pin_memory": False})

    dataloader.DataLoader = UnpinnedLoader
    # speculators.train.optimizers looks torch.optim.Muon up when it builds the optimizers.
    torch.optim.Muon = CpuMuon
    trainer.get_local_rank = lambda: CPU
    recovery.get_local_rank = lambda: 0  # read as torch.device("cpu", 0)


def main(argv: list[str]) -> None:
    if torch.accelerator.current_accelerator() is None:
        hand_the_cpu()
    from speculators.train.cli import main as train
    from speculators.train.config import TrainConfig

    train(TrainConfig.resolve(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
