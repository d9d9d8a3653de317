"""The layer convention, checked against a hand-written forward of a tiny Llama."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors import safe_open

from workflow_scripts.hidden_states import (
    default_aux_layer_ids,
    extract,
    load_verifier,
    resolve_aux_layer_ids,
    run_shard,
    token_budget_batches,
    write_index,
)


def manual_residual_stream(model, input_ids):
    """Inputs of every decoder layer and the pre-norm final state, computed layer by layer."""
    base = model.model
    h = base.embed_tokens(input_ids)
    pos = torch.arange(input_ids.shape[1]).unsqueeze(0)
    pe = base.rotary_emb(h, pos)
    n = input_ids.shape[1]
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    inputs = []
    for layer in base.layers:
        inputs.append(h)
        h = layer(h, attention_mask=mask, position_ids=pos, position_embeddings=pe)
        h = h[0] if isinstance(h, tuple) else h
    return inputs, h


@torch.inference_mode()
def test_captured_states_are_layer_inputs_and_prenorm_final(tiny_llama_dir):
    model = load_verifier(str(tiny_llama_dir), "cpu", torch.float32)
    ids = [[5, 17, 42, 7, 99, 3, 11], [8, 9, 10]]
    samples = [{"input_ids": x} for x in ids]
    aux_ids = default_aux_layer_ids(model.config.num_hidden_layers)
    assert aux_ids == [2, 4, 5]
    states = extract(model, samples, aux_ids, batch_tokens=64, store_dtype=torch.float32)
    for (aux, final), x in zip(states, ids):
        layer_inputs, pre_norm = manual_residual_stream(model, torch.tensor([x]))
        expected_aux = torch.cat([layer_inputs[i][0] for i in aux_ids], dim=-1)
        torch.testing.assert_close(aux, expected_aux, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(final, pre_norm[0], rtol=1e-4, atol=1e-4)
        # A post-norm final state or an off-by-one layer must not pass.
        assert not torch.allclose(final, model.model.norm(pre_norm)[0], atol=1e-3)
        wrong = torch.cat([layer_inputs[i + 1][0] for i in aux_ids[:2]], dim=-1)
        assert not torch.allclose(aux[:, : wrong.shape[1]], wrong, atol=1e-3)


def test_batched_and_single_extraction_agree(tiny_llama_dir):
    model = load_verifier(str(tiny_llama_dir), "cpu", torch.float32)
    samples = [{"input_ids": list(range(3, 3 + n))} for n in (9, 4, 6)]
    batched = extract(model, samples, [1, 2, 4], batch_tokens=64, store_dtype=torch.float32)
    single = extract(model, samples, [1, 2, 4], batch_tokens=1, store_dtype=torch.float32)
    for (a1, f1), (a2, f2) in zip(batched, single):
        torch.testing.assert_close(a1, a2, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(f1, f2, rtol=1e-4, atol=1e-4)


def test_token_budget_batches():
    batches = token_budget_batches([5, 1, 9, 3], batch_tokens=10)
    assert sorted(i for b in batches for i in b) == [0, 1, 2, 3]
    assert batches == [[1, 3], [0], [2]]


def test_aux_layer_ids_validation():
    assert resolve_aux_layer_ids(None, 30) == [2, 15, 27]
    with pytest.raises(ValueError, match="aux_layer_ids"):
        resolve_aux_layer_ids([2, 2, 5], 30)
    with pytest.raises(ValueError, match="aux_layer_ids"):
        resolve_aux_layer_ids([2, 30], 30)


def test_shards_are_unpadded_and_partition_the_samples(tiny_llama_dir, tmp_path):
    rows = [{"id": f"s{i}", "input_ids": list(range(1, 4 + i)), "loss_mask": [0] * 2 + [1] * (1 + i), "length": 3 + i, "num_loss_tokens": 1 + i} for i in range(7)]
    pq.write_table(pa.Table.from_pylist(rows[:5]), tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows[5:]), tmp_path / "eval.parquet")
    shards = [str(tmp_path / f"shard-{k:05d}.safetensors") for k in range(2)]
    for k, out in enumerate(shards):
        run_shard(str(tmp_path / "train.parquet"), str(tmp_path / "eval.parquet"), str(tiny_llama_dir), k, 2, out,
                  aux_layer_ids=None, batch_tokens=32, dtype="bfloat16", device="cpu", threads=1)  # fmt: skip
    seen = []
    for out in shards:
        with safe_open(out, framework="pt") as f:
            ids = json.loads(f.metadata()["sample_ids"])
            seen += ids
            n_tokens = sum(len(r["input_ids"]) for r in rows if r["id"] in ids)
            hs = f.get_tensor("hidden_states")
            assert hs.shape == (n_tokens, 3 * 128) and hs.dtype == torch.bfloat16
            assert f.get_tensor("verifier_last_hidden_states").shape == (n_tokens, 128)
            assert f.get_tensor("offsets")[-1].item() == n_tokens
    assert sorted(seen) == sorted(r["id"] for r in rows)
    write_index(shards, str(tiny_llama_dir), str(tmp_path / "index.json"))
    index = json.loads((tmp_path / "index.json").read_text())
    assert index["aux_layer_ids"] == [2, 4, 5]
    assert index["num_samples"] == 7
