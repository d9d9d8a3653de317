"""DFlash2 (`train.method: dflash2`): DFlash (train/methods/dflash.py) with two local
convolutions a layer and a candidate selector that reranks the block's top tokens by their
predecessor. It drafts over the verifier's whole vocabulary (`vocab.draft_vocab_size` must be
the verifier's): its checkpoint has no lm_head, vLLM takes the verifier's. vLLM serves it as
`dflash`, the candidate head named by the checkpoint's architecture, on its V2 model runner
only (GPUs). Its drafting is not replayed by parity yet."""

from __future__ import annotations

from eagleflow.train.methods.base import Serving
from eagleflow.train.methods.dflash import BlockDrafter


class DFlash2(BlockDrafter):
    name = "dflash2"
    serving = Serving("dflash", takes_k=False)
    estimate = "speculators' expected accepted length per block, through the candidate selector"
    whole_vocabulary = True
    # vLLM's V1 runner would load the checkpoint and draft through DFlash's proposer, which
    # never calls the candidate head: a DFlash draft, silently, not the one trained.
    gpu_only = (
        "vLLM serves DFlash2's candidate head on its V2 model runner only, which needs Triton "
        "(no CPU backend): train it for a GPU host, or pick eagle3, peagle or dflash here"
    )
