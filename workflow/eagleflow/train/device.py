"""Where a training process runs: its device, rank and world size, autocast, and the draft's
attention and loss implementations for that device."""

from __future__ import annotations

import importlib.util
import os
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

from eagleflow.train.attention import DOC_SDPA
from eagleflow.train.config import TrainConfig

# torch's default flex-attention block (create_block_mask's BLOCK_SIZE), which speculators keeps.
FLEX_BLOCK_SIZE = 128


@dataclass(frozen=True)
class Runtime:
    rank: int
    world_size: int
    device: torch.device
    attn_impl: str
    loss_implementation: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def step_length(self, batch_tokens: int) -> int:
        """The length every packed batch of at most `batch_tokens` is padded to here (0: none).

        On CUDA the draft's forward is torch.compile'd (speculators compiles it whenever CUDA is
        there): one shape for every step is one compile, where packed batches of varying length
        recompile. Flex attention also needs whole blocks: speculators extends its block mask
        for each TTT step by whole 128-token blocks, so a 15,575-token batch meets a
        15,616-token mask at the second step and is refused. On CPU nothing compiles."""
        if self.device.type != "cuda" and self.attn_impl != "simple_flex_attention":
            return 0
        return -(-batch_tokens // FLEX_BLOCK_SIZE) * FLEX_BLOCK_SIZE

    def autocast(self):
        # bf16 compute on GPUs, float32 master weights; CPUs without bf16 units take slow paths in bf16.
        return torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda" else nullcontext()

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def stepped(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model as a training step runs it: across ranks, DistributedDataParallel, whose
        all-reduce of the gradient buckets overlaps the backward pass and averages them over
        the ranks; alone, the model itself. A method may leave a trainable tensor out of a
        forward (find_unused_parameters); the buffers (vocabulary maps, rotary tables) are the
        same on every rank and never change, so they are not broadcast each step."""
        if self.world_size == 1:
            return model
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids, find_unused_parameters=True, broadcast_buffers=False)


def resolve_impls(attn_impl: str, loss_implementation: str, cuda: bool, triton: bool) -> tuple[str, str]:
    """("auto" resolved) attention and loss implementations for the device. Pure.

    Flex attention has no CPU backward and the fused loss is a Triton kernel, so on CPU
    "auto" means doc_sdpa (SDPA per packed sample, train.attention) and the eager loss;
    asking for them explicitly there is an error.
    """
    attn = attn_impl if attn_impl != "auto" else ("simple_flex_attention" if cuda else DOC_SDPA)
    loss = loss_implementation if loss_implementation != "auto" else ("fused" if cuda and triton else "eager")
    if attn == "simple_flex_attention" and not cuda:
        raise ValueError(
            "train.attn_impl: simple_flex_attention needs CUDA (flex "
            "attention has no CPU backward); use auto, sdpa or eager"
        )
    if loss == "fused" and not (cuda and triton):
        raise ValueError("train.loss_implementation: fused needs CUDA and Triton; use auto or eager")
    return attn, loss


def untie_fused_loss_autotuners() -> None:
    """Give speculators' fused-loss forward and backward kernels a configs list each.

    speculators 0.9 decorates both kernels with one `triton.autotune`, so their autotuners
    share one configs list; Dynamo (torch 2.11, on an H200) traces the forward and the backward
    inside the compiled draft forward and stops with "ListVariable(length=21) is already
    tracked for mutation". Copies of the list are the same configs under two identities.
    Idempotent."""
    from speculators.losses import fused

    for kernel in (fused.loss_forward_kernel, fused.loss_backward_kernel):
        if isinstance(getattr(kernel, "configs", None), list):
            kernel.configs = list(kernel.configs)


def init_runtime(cfg: TrainConfig) -> Runtime:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    cuda = torch.cuda.is_available()
    if cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if cuda else "gloo")
    attn, loss = resolve_impls(
        cfg.attn_impl, cfg.loss_implementation, cuda, importlib.util.find_spec("triton") is not None
    )
    if loss == "fused":
        untie_fused_loss_autotuners()
    return Runtime(rank, world_size, device, attn, loss)
