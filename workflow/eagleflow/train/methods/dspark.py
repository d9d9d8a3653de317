"""DSpark (`train.method: dspark`): DFlash (train/methods/dflash.py) with a Markov
logit-bias and a confidence head, drafting from the anchor on (its slot is sampled too, so a
block drafts block_size tokens). vLLM serves it as `dspark` on its V2 model runner only
(GPUs). Its drafting is not replayed by parity yet."""

from __future__ import annotations

from eagleflow.train.methods.base import Serving
from eagleflow.train.methods.dflash import BlockDrafter


class DSpark(BlockDrafter):
    name = "dspark"
    serving = Serving("dspark", takes_k=False)
    estimate = "speculators' expected accepted length per block"
    sample_from_anchor = True
    gpu_only = (
        "vLLM serves DSpark on its V2 model runner only, which needs Triton (no CPU backend): "
        "train it for a GPU host, or pick eagle3, peagle or dflash here"
    )
