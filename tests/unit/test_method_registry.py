"""The draft methods' registry (train/methods/): one module per method and nothing else naming
one. The config's schema lists the registry's methods; no module outside train/methods/
branches on a method's name; and a method defined here, registered, is planned, trained,
exported and served with no other edit."""

import ast
import json
from typing import Literal

import pytest
import torch
import yaml

from eagleflow import rule_params
from eagleflow.benchmark.speculative import read_draft_config, speculative_config
from eagleflow.common.config import typed
from eagleflow.common.fingerprint import ROOT
from eagleflow.plan.sizes import Geometry, draft_export_bytes, draft_params, draft_positions, optimizer_state_floats
from eagleflow.train.config import TrainConfig
from eagleflow.train.device import Runtime
from eagleflow.train.draft import export_draft, load_draft
from eagleflow.train.methods import METHODS, DraftMethod, DraftSpec, Serving, draft_method, method_of, register
from eagleflow.train.methods.eagle3 import on_eagle3_layers
from eagleflow.train.optimizer import build_optimizer
from eagleflow.train.steps import packed_batch, train_step
from tests.helpers import REPO, TINY_AUX, TINY_VOCAB, random_samples

DEFAULT = yaml.safe_load((REPO / "config/config.yaml").read_text())
CPU = Runtime(0, 1, torch.device("cpu"), "doc_sdpa", "eager")


def test_the_schema_lists_the_registered_methods():
    schema = yaml.safe_load((REPO / "workflow/schemas/config.schema.yaml").read_text())
    assert sorted(schema["properties"]["train"]["properties"]["method"]["enum"]) == sorted(METHODS)


def test_no_module_outside_the_methods_names_one():
    """A method's name as a string constant anywhere else in the package or the rules is a
    branch on it that its module should hold."""
    methods = ROOT / "train/methods"
    files = [p for p in ROOT.rglob("*.py") if methods not in p.parents] + sorted((ROOT.parent / "rules").glob("*.smk"))
    named = []
    for path in files:
        if path.suffix == ".smk":
            named += [f"{path.name}: {name}" for name in METHODS if f'"{name}"' in path.read_text()]
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in METHODS:
                named.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value}")
    assert named == []


# --- a toy method: speculators' EAGLE-3 model with a parameter of its own, under its own name ----


class Toy(DraftMethod):
    """EAGLE-3's chain on EAGLE-3's layers, served at its trained length."""

    name = "toy"
    serving = Serving("eagle3", takes_k=False)
    estimate = "a toy's chain estimate"
    chain = True

    def positions(self, cfg):
        return list(range(cfg.ttt_steps))

    def draft_config(self, verifier, cfg, draft_vocab_size, aux_layer_ids, attn_impl):
        return on_eagle3_layers(self, verifier, cfg, draft_vocab_size, aux_layer_ids, attn_impl)

    def positions_per_batch(self, cfg):
        return cfg.batch_tokens * cfg.ttt_steps


@pytest.fixture
def toy():
    """Toy registered in speculators' registries (its model and config) and in eagleflow's,
    for the test only."""
    from speculators import SpeculatorModel, SpeculatorModelConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    class ToyConfig(Eagle3SpeculatorConfig):
        speculators_model_type: Literal["toy"] = "toy"

    ToyConfig.model_rebuild(_types_namespace={"torch": torch})  # what its parent's fields name

    class ToyDraft(Eagle3DraftModel):
        config_class = ToyConfig

        def __init__(self, config):
            super().__init__(config)
            # Trained, and in no formula: the plan counts what the method builds.
            self.toy_scale = torch.nn.Parameter(torch.ones(config.transformer_layer_config.hidden_size))

    SpeculatorModelConfig.register("toy")(ToyConfig)
    SpeculatorModel.register("toy")(ToyDraft)
    method = register(Toy())
    yield method
    del METHODS["toy"], SpeculatorModel.registry["toy"], SpeculatorModelConfig.registry["toy"]


def test_a_method_registered_here_is_planned_trained_exported_and_served(toy, tiny_llama_dir, tmp_path):
    train = {**DEFAULT["train"], "method": "toy", "ttt_steps": 2}
    cfg = typed(TrainConfig, train, "train")
    assert draft_method("toy") is toy
    t2d = torch.zeros(TINY_VOCAB, dtype=torch.bool)
    t2d[::2] = True
    d2t = torch.nonzero(t2d).flatten() - torch.arange(int(t2d.sum()))
    torch.manual_seed(0)
    draft = toy.build(DraftSpec(str(tiny_llama_dir), d2t, t2d, TINY_AUX, toy.attn_impl(CPU.attn_impl)), cfg)
    trainable = {n: p for n, p in draft.named_parameters() if p.requires_grad}
    assert "toy_scale" in trainable

    # Planned: the plan's counts are the draft's, its own parameter included.
    g = Geometry.from_config(json.loads((tiny_llama_dir / "config.json").read_text()))
    frozen = sum(p.numel() for p in draft.parameters() if not p.requires_grad)
    assert draft_params(g, train, TINY_VOCAB // 2, len(TINY_AUX)) == (
        sum(p.numel() for p in trainable.values()),
        frozen,
    )
    assert optimizer_state_floats(g, train, TINY_VOCAB // 2, len(TINY_AUX)) > 0
    assert draft_positions(train) == train["batch_tokens"] * 2

    # Trained a step, its metrics summarised as its chain's.
    samples = [
        toy.align(s.input_ids, s.hidden_states, s.verifier_last_hidden_states, s.loss_mask)
        for s in random_samples([30, 25], seed=1)
    ]
    before = {n: p.detach().clone() for n, p in trainable.items()}
    keys, fwd = toy.metric_keys(cfg), toy.forward_kwargs(cfg, "eager")
    optimizer = build_optimizer(draft, "adamw", 1e-3, 0.0)
    step = dict(lr=1e-3, loss_scale=1.0, grad_clip=1.0, keys=keys)
    _, totals = train_step(
        draft, list(trainable.values()), optimizer, packed_batch(samples, 128, CPU), CPU, fwd, **step
    )
    assert any(not torch.equal(p, before[n]) for n, p in trainable.items())
    summary = toy.summarise(dict(zip(keys, totals.tolist(), strict=True)), cfg)
    assert summary["estimated_acceptance_length"] == 1.0 + summary["full_acc_0"] + summary["full_acc_1"]

    # Exported as the plan sized it, and reloaded as its own model.
    out = tmp_path / "draft"
    export_draft(draft, draft.state_dict(), out, str(tiny_llama_dir))
    size = (out / "model.safetensors").stat().st_size
    assert 0 <= size - draft_export_bytes(g, train, TINY_VOCAB // 2, len(TINY_AUX)) < 4096  # the header
    config = read_draft_config(str(out))
    assert method_of(config) is toy
    assert type(load_draft(str(out), str(tiny_llama_dir), attn_impl="sdpa")) is type(draft)

    # Served: the benchmark's speculative config, from a variant of the method, and the
    # report's estimate.
    run = {**DEFAULT, "variants": {"t": {"train": {"method": "toy", "ttt_steps": 2}}}}
    serving = rule_params.draft_serving(run, "t")
    assert speculative_config(str(out), config, serving, 5) == {
        "method": "eagle3",
        "num_speculative_tokens": 2,
        "model": str(out.resolve()),
    }
    assert rule_params.acceptance_estimate(run, "t") == "a toy's chain estimate"
