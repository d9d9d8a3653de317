"""train.optimizer: Muon on the draft's hidden matrices and AdamW on the rest, stepped,
scheduled and checkpointed as one optimizer."""

import pytest
import torch

from eagleflow.train.checkpoint import load_optimizer_state, optimizer_state
from eagleflow.train.optimizer import build_optimizer, takes_muon
from tests.helpers import tiny_draft


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest(tiny_llama_dir):
    model = tiny_draft(tiny_llama_dir, ttt_steps=2)
    opt = build_optimizer(model, "muon", lr=1e-3, weight_decay=0.0)
    muon, adamw = opt.optimizers
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    names = {id(p): n for n, p in model.named_parameters()}
    in_muon = {names[id(p)] for g in muon.param_groups for p in g["params"]}
    in_adamw = {names[id(p)] for g in adamw.param_groups for p in g["params"]}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert in_muon | in_adamw == trainable and not in_muon & in_adamw
    assert "fc.weight" in in_muon and any("self_attn.q_proj" in n for n in in_muon)
    assert all(model.get_parameter(n).ndim == 1 for n in in_adamw)  # the norms
    # A trainable vocabulary matrix (lm_head, embeddings: frozen in this draft) would stay with AdamW.
    assert not takes_muon("lm_head.weight", torch.zeros(64, 8)) and takes_muon("fc.weight", torch.zeros(64, 8))
    assert not takes_muon("layers.0.mlp.up_proj.weight", torch.zeros(1, 8))  # a vector in a matrix's shape
    with pytest.raises(ValueError, match="neither adamw nor muon"):
        build_optimizer(model, "sgd", lr=1e-3, weight_decay=0.0)


def test_the_loop_sets_one_learning_rate_and_a_checkpoint_restores_both_states(tiny_llama_dir):
    model = tiny_draft(tiny_llama_dir, ttt_steps=2)
    opt = build_optimizer(model, "muon", lr=1e-3, weight_decay=0.0)
    for group in opt.param_groups:  # as train.steps.train_step sets the schedule's rate
        group["lr"] = 5e-4
    assert all(g["lr"] == 5e-4 for o in opt.optimizers for g in o.param_groups)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    for p in before:
        model.get_parameter(p).grad = torch.ones_like(before[p])
    opt.step()
    opt.zero_grad(set_to_none=True)
    assert all(not torch.equal(model.get_parameter(n), before[n]) for n in before)
    assert all(model.get_parameter(n).grad is None for n in before)
    saved = optimizer_state(model, opt)
    fresh_model = tiny_draft(tiny_llama_dir, ttt_steps=2)
    fresh = build_optimizer(fresh_model, "muon", lr=1e-3, weight_decay=0.0)
    load_optimizer_state(fresh_model, fresh, {k: t.clone() for k, t in saved[0].items()}, saved[1])
    for a, b in zip(opt.optimizers, fresh.optimizers, strict=True):
        for (_, sa), (_, sb) in zip(a.state_dict()["state"].items(), b.state_dict()["state"].items(), strict=True):
            assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    for group in fresh.param_groups:  # a resumed run's schedule reaches the restored groups
        group["lr"] = 2e-4
    assert all(g["lr"] == 2e-4 for o in fresh.optimizers for g in o.param_groups)
    adamw = build_optimizer(fresh_model, "adamw", lr=1e-3, weight_decay=0.0)
    with pytest.raises(ValueError, match="another train.optimizer's: it lacks"):
        load_optimizer_state(fresh_model, adamw, {k: t.clone() for k, t in saved[0].items()}, saved[1])
