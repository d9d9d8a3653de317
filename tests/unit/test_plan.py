"""The plan before a run: token counts, the verifier's and the draft's sizes against real
models, and the settings it names when a run does not fit."""

import dataclasses
import json
import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM

from eagleflow.common.atomic import write_jsonl
from eagleflow.common.config import typed
from eagleflow.dag.plan.loads import RunInfoLine
from eagleflow.dag.plan.needs import (
    distinct_drafts,
    load_merged_config,
    make_plan,
    planned_disk_line,
    render,
    summary_line,
)
from eagleflow.dag.plan.sizes import (
    Geometry,
    draft_export_bytes,
    draft_params,
    draft_positions,
    estimated_weight_bytes,
    optimizer_state_floats,
)
from eagleflow.dag.plan.tokens import planned_tokens, tokens_from_prompts
from eagleflow.dag.variants import merged
from eagleflow.train.config import TrainConfig
from eagleflow.train.draft import export_draft
from eagleflow.train.methods import METHODS, DraftSpec
from eagleflow.train.optimizer import build_optimizer
from tests.helpers import REPO

REPO_CONFIG = load_merged_config([], REPO)
DEFAULT = REPO_CONFIG


def test_prompt_tokens_bound_each_turn_with_every_earlier_turn_and_reply():
    prompts = [{"turns": ["a" * 40, "b" * 80]}, {"system": "s" * 8, "turns": ["c" * 4]}]
    t = tokens_from_prompts(prompts, max_tokens=100, max_seq_len=200, source="x")
    # At 3 characters per token and two messages of template per turn (common.token_estimate):
    # turn 1: 13 + 32 + 100; turn 2 adds 26 + 32 + 100 (cut at 200); the system prompt 2 + 16.
    assert t.samples == 3 and t.longest == 200
    assert t.tokens == 145 + 200 + (2 + 16 + 1 + 32 + 100)


def test_weight_estimate_matches_real_checkpoints_of_every_family(tiny_verifier):
    family, path = tiny_verifier
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=family == "kimi_k2")
    bf16_bytes = sum(p.numel() for p in model.parameters()) * 2
    estimate = estimated_weight_bytes(json.loads((path / "config.json").read_text()))
    # Norms and biases are left out of the estimate: within 3% on these tiny models, less on large ones.
    assert estimate == pytest.approx(bf16_bytes, rel=0.03)


def test_the_kimi_example_verifier_is_about_595_gb_in_int4():
    config = json.loads((REPO / "config/verifiers/kimi-k2.5.json").read_text())
    int4 = estimated_weight_bytes(config)
    bf16 = estimated_weight_bytes({k: v for k, v in config.items() if k != "quantization_config"})
    assert 580e9 < int4 < 610e9 and 1.9e12 < bf16 < 2.1e12  # 1T parameters


@pytest.mark.parametrize("method", sorted(METHODS))
def test_draft_params_and_export_size_match_the_draft_eagleflow_builds(tiny_llama_dir, tmp_path, method):
    """The plan's counts of every method's draft: trainable and frozen parameters, the
    optimizer's state as train.optimizer builds it, the exported file's size."""
    verifier = json.loads((tiny_llama_dir / "config.json").read_text())
    # Every other token; DFlash2 drafts over the whole vocabulary.
    step = 1 if method == "dflash2" else 2
    vocab = verifier["vocab_size"] // step
    d2t = torch.arange(vocab) * step - torch.arange(vocab)
    t2d = torch.zeros(verifier["vocab_size"], dtype=torch.bool)
    t2d[torch.arange(vocab) * step] = True
    g = Geometry.from_config(verifier)
    for layers in (1, 2):
        train = {**DEFAULT["train"], "method": method, "num_layers": layers, "num_depths": 3, "block_size": 4}
        spec = DraftSpec(str(tiny_llama_dir), d2t, t2d, [2, 4, 5], "sdpa")
        draft = METHODS[method].build(spec, typed(TrainConfig, train, "train"))
        trainable = sum(p.numel() for p in draft.parameters() if p.requires_grad)
        frozen = sum(p.numel() for p in draft.parameters() if not p.requires_grad)
        assert draft_params(g, train, vocab, 3) == (trainable, frozen)
        for kind in ("adamw", "muon"):
            opt = build_optimizer(draft, kind, lr=1e-3, weight_decay=0.0)
            for p in draft.parameters():
                p.grad = torch.zeros_like(p) if p.requires_grad else None
            opt.step()
            states = [st for o in getattr(opt, "optimizers", [opt]) for st in o.state.values()]
            held = sum(t.numel() for st in states for t in st.values() if t.ndim)  # not AdamW's step counts
            assert optimizer_state_floats(g, {**train, "optimizer": kind}, vocab, 3) == held, kind
        out = tmp_path / f"draft-{method}-{layers}"
        export_draft(draft, draft.state_dict(), out, str(tiny_llama_dir))
        size = (out / "model.safetensors").stat().st_size
        assert 0 <= size - draft_export_bytes(g, train, vocab, 3) < 4096  # the safetensors header


def test_draft_sizes_are_remembered_across_processes_keyed_by_what_decides_them(tiny_llama_dir, monkeypatch, caplog):
    """Counting builds the draft (seconds, in every `snakemake` call that plans training): a
    count is remembered beside the file digests, read back by a later process (here: the
    in-process cache cleared), and counted again for other arguments or a corrupt file."""
    from eagleflow.dag.plan import sizes

    monkeypatch.setenv("EAGLEFLOW_DIGEST_CACHE", str(tiny_llama_dir.parent / "digests" / "d.json"))
    g = Geometry.from_config(json.loads((tiny_llama_dir / "config.json").read_text()))
    train = {**DEFAULT["train"], "num_layers": 1}
    sizes._counted.cache_clear()
    counted = sizes.draft_sizes(g, train, 64, 3)
    remembered = json.loads(sizes.remembered_sizes_path().read_text())
    assert list(remembered.values()) == [dataclasses.asdict(counted)]

    def no_count(*args):
        raise AssertionError("counted again")

    with monkeypatch.context() as m:
        m.setattr(sizes, "_count", no_count)
        sizes._counted.cache_clear()
        assert sizes.draft_sizes(g, train, 64, 3) == counted
        for changed in ((g, train, 32, 3), (g, train, 64, 2), (g, {**train, "num_layers": 2}, 64, 3)):
            sizes._counted.cache_clear()
            with pytest.raises(AssertionError, match="counted again"):
                sizes.draft_sizes(*changed)

    sizes.remembered_sizes_path().write_text("{not json")
    sizes._counted.cache_clear()
    with caplog.at_level(logging.WARNING):
        assert sizes.draft_sizes(g, train, 64, 3) == counted
    assert "cannot read the remembered draft sizes" in caplog.text
    assert list(json.loads(sizes.remembered_sizes_path().read_text()).values()) == [dataclasses.asdict(counted)]
    sizes._counted.cache_clear()


def test_a_run_of_several_methods_plans_each_drafts_training():
    config = {
        **DEFAULT,
        "variants": {"flash": {"train": {"method": "dflash"}}, "k2": {"benchmark": {"num_speculative_tokens": 2}}},
    }
    drafts = distinct_drafts(config)
    assert [d.train["method"] for d in drafts.values()] == ["eagle3", "dflash"]
    assert list(drafts)[0] == "default (eagle3): " and list(drafts)[1].endswith("(dflash): ")
    assert distinct_drafts(DEFAULT) == {"": (DEFAULT["train"], DEFAULT["vocab"]["draft_vocab_size"])}
    # DFlash runs its layers on anchors times the block, EAGLE-3 on every token per step.
    assert draft_positions(drafts[list(drafts)[1]].train) == 512 * 8 and draft_positions(DEFAULT["train"]) == 512 * 3


def write_dataset(root, run, lengths):
    for split, ls in (("train", lengths[:-1]), ("eval", lengths[-1:])):
        path = root / f"results/{run}/dataset/{split}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"length": ls}), path)


def plan_config(tmp_path, tiny_llama_dir, **hidden_states):
    verifier = tmp_path / "resources/verifier/tiny"
    verifier.parent.mkdir(parents=True)
    verifier.symlink_to(tiny_llama_dir)
    write_jsonl(tmp_path / "prompts.jsonl", [{"id": "p", "turns": ["hello"]}])
    config = merged(
        REPO_CONFIG,
        {"run": "t", "verifier": {"name": "tiny"}, "prompts": {"source": "prompts.jsonl"}},
    )
    return merged(config, {"hidden_states": hidden_states})


def test_the_plan_counts_written_prompts_before_they_are_written_and_exactly_after(tmp_path):
    config = merged(REPO_CONFIG, {"run": "w", "prompts": {"source": None, "written": {"count": 100, "turns": 2}}})
    before = planned_tokens(config, tmp_path, assume_prompt_tokens=50)
    assert before.samples == 2 * 90 and "90 written conversations of 2 turns at 128 tokens" in before.source
    mixed = planned_tokens(merged(config, {"prompts": {"source": "config/prompts/demo.jsonl"}}), REPO, 50)
    assert mixed.samples > before.samples and "train prompts of" in mixed.source
    write_jsonl(tmp_path / "results/w/prompts/train.jsonl", [{"turns": ["a" * 30]}] * 7)
    after = planned_tokens(config, tmp_path, assume_prompt_tokens=50)
    assert after.samples == 7 and "the 7 train prompts of" in after.source


def test_the_plan_counts_exact_tokens_once_the_dataset_exists(tmp_path, tiny_llama_dir):
    config = plan_config(tmp_path, tiny_llama_dir)
    before = make_plan(config, tmp_path, gpu_memory=None)
    assert before.tokens.source.startswith("upper bound")
    write_dataset(tmp_path, "t", [100, 50, 30])
    plan = make_plan(config, tmp_path, gpu_memory=None)
    assert (plan.tokens.samples, plan.tokens.tokens, plan.tokens.longest) == (3, 180, 100)
    assert plan.tokens.source.startswith("exact")
    # 3 aux states + the final one of hidden 128 in bf16, + id and mask; per sample 41 bytes.
    assert plan.disk[0]["bytes"] == 180 * (4 * 128 * 2 + 5) + 3 * 41
    fp8 = make_plan(merged(config, {"hidden_states": {"dtype": "float8_e4m3fn"}}), tmp_path, gpu_memory=None)
    assert fp8.disk[0]["bytes"] == 180 * (4 * 128 + 16 + 5) + 3 * 41
    assert "Fits" in render(plan) and "fits" in summary_line(plan)


def test_the_plan_counts_the_bytes_only_the_output_cache_holds(tmp_path, tiny_llama_dir, monkeypatch):
    from eagleflow.runtime.output_cache import OutputCache

    monkeypatch.chdir(tmp_path)
    config = plan_config(tmp_path, tiny_llama_dir)
    assert not [row for row in make_plan(config, tmp_path, gpu_memory=None).disk if row["stage"] == "output cache"]
    shard = Path(f"results/{config['run']}/hidden_states/shard-00000.safetensors")
    shard.parent.mkdir(parents=True)
    shard.write_bytes(b"s" * 3000)
    OutputCache(shard.parent / ".done", "shard-00000").keep("k", {"shard": shard})
    (row,) = [row for row in make_plan(config, tmp_path, gpu_memory=None).disk if row["stage"] == "output cache"]
    assert row["bytes"] == 0 and row["what"].startswith("1 entries")  # a link of the shard in place
    shard.unlink()
    shard.write_bytes(b"t")  # extracted again, other bytes: the entry alone holds the old ones
    (row,) = [row for row in make_plan(config, tmp_path, gpu_memory=None).disk if row["stage"] == "output cache"]
    assert row["bytes"] == 3000 and "prune" in row["what"]


def test_a_run_that_does_not_fit_names_settings_that_would(tmp_path, tiny_llama_dir, monkeypatch):
    import eagleflow.dag.plan.needs as plan_module

    config = plan_config(tmp_path, tiny_llama_dir)
    write_dataset(tmp_path, "t", [1000] * 10)
    need = make_plan(config, tmp_path, gpu_memory=None).disk[0]["bytes"]
    monkeypatch.setattr(plan_module, "free_bytes", lambda path: need // 3 if "hidden_states" in str(path) else 10**15)
    plan = make_plan(config, tmp_path, gpu_memory=None)
    text = render(plan)
    assert "Does not fit" in text and "DOES NOT FIT" in summary_line(plan)
    assert "hidden_states.dtype: float8_e4m3fn" in text and "hidden_states.mode: online" in text
    # a third of the space holds about a third of the samples
    assert "prompts.max_train: about 3 samples" in text
    fp8_online = make_plan(
        merged(config, {"hidden_states": {"dtype": "float8_e4m3fn", "mode": "online"}}), tmp_path, gpu_memory=None
    )
    assert fp8_online.disk[0]["bytes"] == 0 and not fp8_online.suggestions
    assert "none on disk" in summary_line(fp8_online)


def test_served_mode_plans_no_stored_states_and_the_requests_and_bytes_in_flight(tmp_path, tiny_llama_dir):
    config = merged(
        plan_config(tmp_path, tiny_llama_dir),
        {"hidden_states": {"mode": "served", "served": {"max_inflight_mb": 3}}, "train": {"batch_tokens": 100}},
    )
    write_dataset(tmp_path, "t", [1000] * 10)
    plan = make_plan(config, tmp_path, gpu_memory=None)
    stored, flight = plan.disk[0], plan.disk[1]
    assert stored["bytes"] == 0 and flight["requests_per_epoch"] == plan.tokens.samples
    # The bound plus one training batch, as the trainer holds them (float32).
    from eagleflow.hidden_states.layers import default_aux_layer_ids

    verifier = json.loads((Path(tiny_llama_dir) / "config.json").read_text())
    aux = len(config["hidden_states"]["aux_layer_ids"] or default_aux_layer_ids(verifier["num_hidden_layers"]))
    hidden = verifier["hidden_size"]
    assert flight["bytes"] == 3 * 2**20 + 100 * (aux + 1) * hidden * 4
    line = summary_line(plan)
    assert "none on disk (hidden_states.mode: served)" in line and f"{plan.tokens.samples:,} verifier requests" in line


def test_snakemake_dry_runs_print_the_summary_only_when_states_are_planned(tmp_path, tiny_llama_dir):
    config = plan_config(tmp_path, tiny_llama_dir)
    lines = []
    record = logging.LogRecord("snakemake", 20, "", 0, "stats", None, None)
    record.stats = {"benchmark": 1, "total": 1}
    RunInfoLine(lambda jobs: planned_disk_line(jobs, config, tmp_path), lines.append).emit(record)
    assert lines == []
    handler = RunInfoLine(lambda jobs: planned_disk_line(jobs, config, tmp_path), lines.append)
    record.stats = {"hidden_states": 2, "train": 1, "total": 3}
    handler.emit(record)
    handler.emit(record)
    assert len(lines) == 1 and lines[0].startswith("Hidden states this run writes:")


def test_online_mode_does_not_fit_when_the_verifier_does_not_fit_beside_the_draft(tmp_path, tiny_llama_dir):
    config = plan_config(tmp_path, tiny_llama_dir, mode="online")
    write_dataset(tmp_path, "t", [100, 50, 30])
    roomy = make_plan(config, tmp_path, gpu_memory=10**12)
    assert not roomy.suggestions
    need = next(r["bytes"] for r in roomy.gpu if r["what"].startswith("online mode"))
    tight = make_plan(config, tmp_path, gpu_memory=need - 1)
    assert any(s.startswith("hidden_states.mode: offline") for s in tight.suggestions)
    assert (
        make_plan(merged(config, {"hidden_states": {"mode": "offline"}}), tmp_path, gpu_memory=need - 1).suggestions
        == []
    )


def test_the_plan_says_whether_served_mode_fits_beside_the_trainer_on_one_host(tmp_path, tiny_llama_dir):
    """A host whose GPUs the server fills: what vLLM leaves of each must hold a training
    process. A served run that does not fit is refused with the settings that would; another
    mode's run is told that served mode would not fit its host."""
    one_gpu = {"server": {"gpus": 1, "extra_args": ["--gpu-memory-utilization", "0.9"]}}
    served = merged(plan_config(tmp_path, tiny_llama_dir, mode="served"), one_gpu)
    write_dataset(tmp_path, "t", [100, 50, 30])
    roomy = make_plan(served, tmp_path, gpu_memory=10**13, host_gpus=1)
    (row,) = [r for r in roomy.gpu if r["what"].startswith("served mode on one host")]
    assert "fit" in row["what"] and "do not" not in row["what"] and not roomy.suggestions
    tight = make_plan(served, tmp_path, gpu_memory=10**9, host_gpus=1)
    assert any(s.startswith("hidden_states.served.placement: nodes") for s in tight.suggestions), tight.suggestions
    # GPUs of their own: the memory no longer matters.
    assert not make_plan(served, tmp_path, gpu_memory=10**9, host_gpus=2).suggestions
    offline = make_plan(merged(served, {"hidden_states": {"mode": "offline"}}), tmp_path, gpu_memory=10**9, host_gpus=1)
    assert any("hidden_states.mode: served would not fit this host" in n for n in offline.notes)
    # On nodes of their own (a SLURM run): no verdict for one host.
    nodes = merged(served, {"hidden_states": {"served": {"placement": "nodes", "transfer": "mooncake"}}})
    assert not [r for r in make_plan(nodes, tmp_path, gpu_memory=10**9, host_gpus=1).gpu if "served mode" in r["what"]]


def test_each_draft_is_planned_with_its_own_vocabulary():
    """A variant's vocab.draft_vocab_size sizes its draft (DFlash2 drafts over the verifier's
    whole vocabulary, which its model refuses to be built without)."""
    config = {
        **DEFAULT,
        "variants": {"whole": {"train": {"method": "dflash2"}, "vocab": {"draft_vocab_size": 49152}}},
    }
    drafts = distinct_drafts(config)
    assert [d.vocab for d in drafts.values()] == [DEFAULT["vocab"]["draft_vocab_size"], 49152]
