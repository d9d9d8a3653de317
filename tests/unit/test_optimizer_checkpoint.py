"""The optimizer's state in a checkpoint (train/checkpoint.py): torch's own flattened state
dict, its tensors through safetensors and its values through JSON."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagleflow.train.checkpoint import inner_optimizers, load_optimizer_state, optimizer_state
from eagleflow.train.optimizer import build_optimizer
from tests.helpers import tiny_draft


@pytest.mark.parametrize("kind", ["adamw", "muon"])
def test_the_optimizer_state_round_trips_through_safetensors_and_json(tiny_llama_dir, tmp_path, kind):
    """torch's flattened optimizer state, split into safetensors' tensors and JSON's values,
    restores into a fresh optimizer as it was: every tensor, every hyperparameter (tuples
    included), keyed by parameter name; a stepped restored optimizer moves the draft as the
    original does."""
    models = [tiny_draft(tiny_llama_dir) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [build_optimizer(m, kind, lr=1e-2, weight_decay=0.01) for m in models]
    params = [p for p in models[0].parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p)
    opts[0].step()
    tensors, values = optimizer_state(models[0], opts[0])
    assert tensors and all(k.startswith("state.") for k in tensors)
    save_file(tensors, str(tmp_path / "optimizer.safetensors"))
    load_optimizer_state(
        models[1], opts[1], load_file(str(tmp_path / "optimizer.safetensors")), json.loads(json.dumps(values))
    )
    for a, b in zip(inner_optimizers(opts[0]), inner_optimizers(opts[1]), strict=True):
        sa, sb = a.state_dict(), b.state_dict()
        assert sa["param_groups"] == sb["param_groups"]
        for i, state in sa["state"].items():
            assert all(torch.equal(v, sb["state"][i][k]) for k, v in state.items())
    models[1].load_state_dict(models[0].state_dict())
    for m, opt in zip(models, opts, strict=True):
        for p in m.parameters():
            if p.requires_grad:
                p.grad = torch.ones_like(p)
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True))
