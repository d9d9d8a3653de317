"""Draft methods (`train.method`): which of speculators' draft models a run trains, one module
each, holding everything about it (train/methods/base.py says what): speculators' model and
config (by speculators' registry name), the draft's config, the batch alignment its data
takes, its metrics and acceptance estimate, its parity replay's proposals, how the plan sizes
it, how vLLM serves it and where. The models, losses and per-method data preparation are
speculators' own; a method's module only configures them.

- `eagle3` (eagle3.py, eagle3_mla.py): EAGLE-3, a chain of `ttt_steps` draft tokens.
- `peagle` (peagle.py): P-EAGLE, EAGLE-3's layer drafting `num_depths` tokens in one forward.
- `dflash` (dflash.py): DFlash, a block drafter in one forward.
- `dflash2` (dflash2.py): DFlash2, DFlash with convolutions and a candidate selector.
- `dspark` (dspark.py): DSpark, DFlash with a Markov and a confidence head.

The registry maps a name to its DraftMethod: nothing else branches on a method's name, and a
method registered here (`register`) is trained, exported, planned and served with no other
edit. workflow/schemas/config.schema.yaml lists the shipped names for the config's check.
"""

from __future__ import annotations

from typing import Any

from eagleflow.train.methods.base import DraftMethod, DraftSpec, Serving, Verifier
from eagleflow.train.methods.dflash import DFlash
from eagleflow.train.methods.dflash2 import DFlash2
from eagleflow.train.methods.dspark import DSpark
from eagleflow.train.methods.eagle3 import Eagle3
from eagleflow.train.methods.peagle import PEagle

__all__ = [
    "METHODS",
    "DraftMethod",
    "DraftSpec",
    "Serving",
    "Verifier",
    "draft_method",
    "method_attn_impl",
    "method_of",
    "register",
]

METHODS: dict[str, DraftMethod] = {}


def register(method: DraftMethod) -> DraftMethod:
    """Add `method` under its name (speculators' registry name of its model)."""
    if method.name in METHODS:
        raise ValueError(f"a draft method {method.name!r} is registered already")
    METHODS[method.name] = method
    return method


for shipped in (Eagle3(), PEagle(), DFlash(), DFlash2(), DSpark()):
    register(shipped)


def draft_method(name: str) -> DraftMethod:
    if name not in METHODS:
        raise ValueError(f"train.method: {name!r} is none of {', '.join(METHODS)}")
    return METHODS[name]


def method_of(draft_config: dict[str, Any]) -> DraftMethod:
    """The method of an exported draft, from its config.json: speculators' checkpoints name it
    (speculators_model_type); a draft in vLLM's own format by its architecture."""
    name = draft_config.get("speculators_model_type")
    if name is not None:
        if name not in METHODS:
            raise ValueError(f"a {name!r} draft (speculators_model_type): eagleflow knows {', '.join(METHODS)}")
        return METHODS[name]
    architectures = set(draft_config.get("architectures") or [])
    for method in METHODS.values():
        if architectures & set(method.vllm_architectures):
            return method
    raise ValueError(
        f"a draft of architectures {sorted(architectures)} without speculators_model_type: no method exports it"
    )


def method_attn_impl(method: DraftMethod, attn_impl: str) -> str:
    """The attention `method` trains with (DraftMethod.attn_impl)."""
    return method.attn_impl(attn_impl)
