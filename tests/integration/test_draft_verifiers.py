"""Drafts for verifiers beyond Llama: Qwen3, DeepSeek-V3 (MLA + MoE, sharded checkpoint)
and a Kimi-K2-style custom-code verifier. Each gets hidden states, a draft trained a few
steps by the real loop, an export, and a reload with equal weights."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file, save_file

from devkit.configs import hidden_states_config, train_config
from devkit.verifiers import VERIFIER_BUILDERS
from eagleflow.common.verifier_config import draft_attention_geometry, read_text_config
from eagleflow.common.verifier_weights import load_verifier_embeddings, load_verifier_lm_head
from eagleflow.hidden_states.index import write_index_of_parts
from eagleflow.hidden_states.run import run_part
from eagleflow.train.config import TrainJob
from eagleflow.train.draft import load_draft
from eagleflow.train.loop import run_train
from eagleflow.train.methods.eagle3_mla import mla_layer_config

TRAIN_CFG = {
    "num_layers": 1,
    "ttt_steps": 2,
    "ttt_step_loss_decay": 1.0,
    "loss": "kl_div",
    "loss_implementation": "eager",
    "attn_impl": "sdpa",
    "lr": 1e-3,
    "weight_decay": 0.0,
    "warmup_steps": 1,
    "grad_clip": 1.0,
    "epochs": 1,
    "batch_tokens": 64,
    "log_every": 1,
    "eval_every": 0,
    "checkpoint_every": 2,
    "seed": 0,
}
DRAFT_VOCAB = 64


def test_mla_geometry_is_derived_from_the_latent_attention_config():
    kimi = {
        "hidden_size": 7168,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
    }
    assert draft_attention_geometry(kimi) == (64, 64, 128)
    llama = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3}
    assert draft_attention_geometry(llama) == (9, 3, 64)


def test_embeddings_come_from_sharded_and_tied_checkpoints(tmp_path):
    embed = torch.randn(16, 4)
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    save_file({"model.embed_tokens.weight": embed}, str(tmp_path / "a.safetensors"))
    save_file({"model.norm.weight": torch.ones(4)}, str(tmp_path / "b.safetensors"))
    index = {"weight_map": {"model.embed_tokens.weight": "a.safetensors", "model.norm.weight": "b.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    e, head = load_verifier_embeddings(str(tmp_path))
    assert torch.equal(e, embed) and torch.equal(head, embed)
    assert torch.equal(load_verifier_lm_head(str(tmp_path)), embed)
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))
    with pytest.raises(KeyError, match="no lm_head"):
        load_verifier_embeddings(str(tmp_path))
    with pytest.raises(KeyError, match="no lm_head"):
        load_verifier_lm_head(str(tmp_path))


def train_tiny_draft(verifier, trust: bool, tmp_path, hidden_states=None, **train_overrides):
    """Hidden states of 10 random samples (`hidden_states`: overrides of that section), a draft
    trained on them by the real loop for one epoch and exported: (draft dir, t2d)."""
    g = torch.Generator().manual_seed(0)
    rows = [
        {
            "id": f"s{i:02d}",
            "input_ids": torch.randint(3, 128, (24,), generator=g).tolist(),
            "loss_mask": [0] * 4 + [1] * 20,
        }
        for i in range(10)
    ]
    pq.write_table(pa.Table.from_pylist(rows[:8]), tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows[8:]), tmp_path / "eval.parquet")
    settings = hidden_states_config(
        **{"backend": "hf", "batch_tokens": 256, "dtype": "bfloat16", "device": "cpu", "num_parts": 1}
        | (hidden_states or {})
    )
    part = str(tmp_path / "part-00000.json")
    manifest = run_part(
        str(tmp_path / "train.parquet"),
        str(tmp_path / "eval.parquet"),
        str(verifier),
        0,
        part,
        settings=settings,
        server=None,
        threads=1,
        gpus=0,
        trust_remote_code=trust,
        log_path=str(tmp_path / "logs/hidden_states.part-00000.log"),
    )
    assert sorted(s["id"] for s in manifest["samples"]) == [r["id"] for r in rows]  # one part: every sample

    t2d = torch.zeros(128, dtype=torch.bool)
    t2d[torch.arange(0, 128, 2)] = True  # draft vocab: the even target ids
    d2t = torch.nonzero(t2d).flatten() - torch.arange(DRAFT_VOCAB)
    save_file({"d2t": d2t, "t2d": t2d}, str(tmp_path / "vocab_map.safetensors"))
    draft_dir = tmp_path / "draft"
    index = str(tmp_path / "index.json")
    write_index_of_parts([part], str(verifier), index)
    job = TrainJob(
        shards=[],
        vocab_map=str(tmp_path / "vocab_map.safetensors"),
        index=index,
        verifier_dir=str(verifier),
        draft_out=str(draft_dir),
        metrics_out=str(tmp_path / "metrics.jsonl"),
        checkpoint_dir=str(tmp_path / "checkpoints"),
        serve_verifier_path=str(verifier),
        threads=1,
    )
    run_train(job, train_config(**TRAIN_CFG, **train_overrides))
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any("loss" in m and m["loss"] == m["loss"] for m in metrics)
    return draft_dir, t2d


def test_draft_for_each_verifier_trains_exports_and_reloads(tiny_verifier, tmp_path):
    from speculators.models.eagle3 import Eagle3DraftModel

    family, verifier = tiny_verifier
    trust = family == "kimi_k2"
    if trust:
        from transformers import AutoConfig

        with pytest.raises(ValueError):  # why speculators' own loader cannot be used
            AutoConfig.from_pretrained(verifier, trust_remote_code=False)
    draft_dir, t2d = train_tiny_draft(verifier, trust, tmp_path)

    config = json.loads((draft_dir / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    layer = config["transformer_layer_config"]
    v = read_text_config(str(verifier))
    assert layer["hidden_size"] == v["hidden_size"]
    assert (layer["num_attention_heads"], layer["num_key_value_heads"], layer["head_dim"]) == draft_attention_geometry(
        v
    )
    assert layer["head_dim"] == 64  # v_head_dim for the MLA verifiers

    saved = load_file(str(draft_dir / "model.safetensors"))
    embed, lm_head = load_verifier_embeddings(str(verifier))
    torch.testing.assert_close(saved["embed_tokens.weight"].float(), embed.to(torch.bfloat16).float())
    torch.testing.assert_close(saved["lm_head.weight"].float(), lm_head[t2d].to(torch.bfloat16).float())

    reloaded = [load_draft(str(draft_dir))]
    if not trust:  # speculators' own reload re-reads the verifier config without trust_remote_code
        reloaded.append(Eagle3DraftModel.from_pretrained(str(draft_dir)))
    for model in reloaded:
        state = model.state_dict()
        assert model.config.eagle_aux_hidden_state_layer_ids == [2, 4, 5]
        torch.testing.assert_close(model.verifier_lm_head.weight.float(), lm_head[t2d].float())
        for name, tensor in saved.items():
            assert torch.equal(state[name].to(tensor.dtype), tensor), name


def test_compact_target_of_the_whole_vocabulary_trains_as_the_final_state(tiny_llama_dir, tmp_path):
    """hidden_states.target: topk with k the verifier's whole vocabulary keeps the distribution
    training builds from the final state (up to float16 logits): the same losses and
    accuracies step by step. With a small k, the stored states shrink and the run still trains
    and exports a draft vLLM's loader reads."""
    rows = {}
    runs = {"state": None, "all": {"target": "topk", "topk": 128}, "top8": {"target": "topk", "topk": 8}}
    for name, hs in runs.items():
        (tmp_path / name).mkdir()
        draft_dir, _ = train_tiny_draft(tiny_llama_dir, False, tmp_path / name, hidden_states=hs)
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        rows[name] = [json.loads(line) for line in lines]
        assert load_draft(str(draft_dir)).config.eagle_aux_hidden_state_layer_ids == [2, 4, 5]
    header = {n: json.loads((tmp_path / n / "index.json").read_text()) for n in rows}
    assert [header[n]["target_topk"] for n in rows] == [0, 128, 8]
    size = {n: sum(p.stat().st_size for p in (tmp_path / n / "samples").rglob("*.safetensors")) for n in rows}
    assert size["top8"] < size["state"]  # 8 x 6 bytes instead of 64 x 2 per token
    keys = [k for k in rows["state"][-1] if k.startswith(("loss", "full_acc"))]
    assert keys
    for want, got in zip(rows["state"], rows["all"], strict=True):
        for k in keys:
            if k in want:
                # Losses to float16's rounding of the logits; an accuracy to two tokens of the 40
                # (this random verifier's distributions are near ties, which tiny weight
                # differences after a few steps can flip, and which ones depends on the CPU's kernels).
                tolerance = {"abs": 2 / 40 + 1e-6} if k.startswith("full_acc") else {"rel": 1e-4}
                assert got[k] == pytest.approx(want[k], **tolerance), (k, want, got)
    assert any(a.get("loss") != b.get("loss") for a, b in zip(rows["state"], rows["top8"], strict=True))


@pytest.mark.parametrize("family", ["deepseek_v3", "kimi_k2"])
def test_mla_draft_trains_and_exports_as_vllm_loads_it(family, tmp_path):
    """train.draft_attention: mla on the MLA verifiers: the latent-attention layer vLLM's
    Eagle3DeepseekV2ForCausalLM serves, exported under the names it reads, and reloaded for
    the replay with equal weights and equal predictions."""
    verifier = VERIFIER_BUILDERS[family](tmp_path / "verifier")
    draft_dir, t2d = train_tiny_draft(verifier, family == "kimi_k2", tmp_path, draft_attention="mla")
    config = json.loads((draft_dir / "config.json").read_text())
    v = read_text_config(str(verifier))
    assert config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and config["model_type"] == "deepseek_v2"
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5] and config["draft_vocab_size"] == DRAFT_VOCAB
    for key in ("hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
        assert config[key] == v[key], key
    assert config["num_hidden_layers"] == 1 and config["first_k_dense_replace"] == 1  # a dense MLP
    saved = load_file(str(draft_dir / "model.safetensors"))
    wide = 2 * v["hidden_size"]
    assert saved["layers.0.self_attn.q_a_proj.weight"].shape == (v["q_lora_rank"], wide)
    assert saved["layers.0.self_attn.kv_a_proj_with_mqa.weight"].shape == (
        v["kv_lora_rank"] + v["qk_rope_head_dim"],
        wide,
    )
    assert saved["layers.0.mlp.gate_proj.weight"].shape == (v["intermediate_size"], v["hidden_size"])
    assert {"fc.weight", "norm.weight", "lm_head.weight", "embed_tokens.weight", "d2t", "t2d"} <= set(saved)
    assert not any(k.startswith("verifier_") for k in saved)

    model = load_draft(str(draft_dir), str(verifier), attn_impl="sdpa").float().eval()
    state = model.state_dict()
    for name, tensor in saved.items():
        assert torch.equal(state[name].to(tensor.dtype), tensor), name
    torch.testing.assert_close(
        model.verifier_lm_head.weight.float(), load_verifier_embeddings(str(verifier))[1][t2d].float()
    )
    # The teacher-forced forward runs and proposes draft-vocabulary tokens at every position.
    hidden = torch.randn(1, 12, 3 * v["hidden_size"])
    ids = torch.randint(3, 128, (1, 12))
    with torch.no_grad():
        draft_tokens = model(hidden, ids, torch.zeros_like(ids), ttt_steps=2)
    assert len(draft_tokens) == 2 and draft_tokens[0].shape == (1, 12)
    assert int(draft_tokens[0].max()) < DRAFT_VOCAB
    with pytest.raises(ValueError, match="multi-head latent attention"):
        mla_layer_config(read_text_config(str(VERIFIER_BUILDERS["llama"](tmp_path / "llama"))), 1, "sdpa")


def test_the_optional_norms_train_export_and_reload(tmp_path):
    """train.norm_before_fc and train.norm_output (speculators' defaults): the draft trains with
    an RMSNorm over its aux states, exports it and both flags where vLLM reads them, and
    reloads with equal weights; vLLM's MLA draft has no norm before fc, so that is refused."""
    verifier = VERIFIER_BUILDERS["llama"](tmp_path / "verifier")
    draft_dir, _ = train_tiny_draft(verifier, False, tmp_path, norm_before_fc=True, norm_output=True)
    config = json.loads((draft_dir / "config.json").read_text())
    assert config["norm_before_fc"] is True and config["norm_output"] is True
    saved = load_file(str(draft_dir / "model.safetensors"))
    assert not torch.equal(saved["input_norm.weight"].float(), torch.ones_like(saved["input_norm.weight"].float()))
    state = load_draft(str(draft_dir)).state_dict()
    for name, tensor in saved.items():
        assert torch.equal(state[name].to(tensor.dtype), tensor), name
    mla = VERIFIER_BUILDERS["deepseek_v3"](tmp_path / "mla")
    (tmp_path / "mla-run").mkdir()
    with pytest.raises(ValueError, match="train.norm_before_fc"):
        train_tiny_draft(mla, False, tmp_path / "mla-run", draft_attention="mla", norm_before_fc=True)


def test_draft_targets_are_the_verifiers_own_logits(tiny_verifier, tmp_path):
    """The trainer's target logits, verifier_lm_head(verifier_norm(final pre-norm state)), must
    be the verifier's logits on the draft vocabulary. The verifier's final norm gets random
    weights first: with the all-ones norm of a fresh model, forgetting to load it would pass."""
    import shutil

    from devkit.configs import build_draft
    from eagleflow.common.verifier_config import safetensors_weight_map
    from eagleflow.common.verifier_weights import FINAL_NORM_NAMES
    from eagleflow.hidden_states.forward import extract, load_verifier
    from eagleflow.hidden_states.layers import default_aux_layer_ids

    family, source = tiny_verifier
    verifier = tmp_path / "verifier"
    shutil.copytree(source, verifier)
    weights = safetensors_weight_map(str(verifier))
    (name,) = [n for n in FINAL_NORM_NAMES if n in weights]
    shard = load_file(str(weights[name]))
    shard[name] = 1.0 + 0.5 * torch.randn_like(shard[name])
    save_file(shard, str(weights[name]), metadata={"format": "pt"})

    trust = family == "kimi_k2"
    model = load_verifier(str(verifier), "cpu", torch.float32, trust_remote_code=trust)
    num_layers = read_text_config(str(verifier))["num_hidden_layers"]
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0]
    ((_, final),) = extract(
        model, [{"input_ids": ids[0].tolist()}], default_aux_layer_ids(num_layers), 256, torch.float32
    )

    t2d = torch.zeros(128, dtype=torch.bool)
    t2d[torch.arange(0, 128, 2)] = True
    d2t = torch.nonzero(t2d).flatten() - torch.arange(DRAFT_VOCAB)
    draft = build_draft(
        str(verifier),
        d2t,
        t2d,
        num_layers=1,
        ttt_steps=2,
        aux_layer_ids=default_aux_layer_ids(num_layers),
        attn_impl="sdpa",
    )
    with torch.no_grad():
        targets = draft.verifier_lm_head(draft.verifier_norm(final.float()))
    torch.testing.assert_close(targets, logits[:, t2d], rtol=1e-4, atol=1e-4)
