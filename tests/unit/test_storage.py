"""Shard storage: fp8 states with per-token scales, what they cost per token, and the round
trip through a shard file into training samples."""

import pytest
import torch

from eagleflow.hidden_states.shard_file import ShardMeta, read_shard_header, write_shard
from eagleflow.hidden_states.storage import (
    FP8,
    dequantize_fp8,
    extraction_dtype,
    quantize_fp8,
    stored_states,
    token_bytes,
)
from eagleflow.train.data import load_shards


def test_fp8_round_trip_error_is_e4m3_rounding_of_each_tokens_own_scale():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3 * 32, generator=g) * torch.logspace(-3, 3, 64).unsqueeze(1)
    q, scale = quantize_fp8(x, 3)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and scale.shape == (64, 3)
    back = dequantize_fp8(q, scale, torch.float32)
    # 3 mantissa bits: at most half a step (1/16) relative; below e4m3's normal range, half
    # the smallest subnormal (2^-10) of the token's own scale.
    bound = torch.maximum(x.abs() / 16, scale.repeat_interleave(32, dim=1) * 2**-10)
    assert ((back - x).abs() <= bound * 1.0001).all()
    # Every state's amax lands on e4m3's largest value.
    assert q.float().reshape(64, 3, 32).abs().amax(-1).eq(448).all()


def test_an_outlier_token_costs_no_other_token_precision():
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    spiked = x.clone()
    spiked[2] *= 1e4
    q, scale = quantize_fp8(x, 1)
    q2, scale2 = quantize_fp8(spiked, 1)
    keep = [0, 1, 3]
    assert dequantize_fp8(q2, scale2, torch.float32)[keep].equal(dequantize_fp8(q, scale, torch.float32)[keep])


def test_token_bytes_for_kimi_k25_halve_with_fp8():
    # 3 aux states + the final one of hidden size 7168.
    assert token_bytes(4, 7168, "bfloat16") == 4 * 7168 * 2 + 5
    assert token_bytes(4, 7168, FP8) == 4 * 7168 + 4 * 4 + 5
    assert token_bytes(4, 7168, FP8) / token_bytes(4, 7168, "bfloat16") == pytest.approx(0.5, abs=0.001)
    assert extraction_dtype(FP8) == "bfloat16" and extraction_dtype("float32") == "float32"


def write_test_shard(path, states, storage):
    samples = [
        {"id": "p0#t0", "split": "train", "input_ids": list(range(5)), "loss_mask": [0, 0, 1, 1, 1]},
        {"id": "p1#t0", "split": "eval", "input_ids": list(range(7)), "loss_mask": [0, 1, 1, 1, 1, 1, 1]},
    ]
    write_shard(path, samples, states, ShardMeta([s["id"] for s in samples], [1, 2, 3], 6, 8), storage)


def test_an_fp8_shard_reads_back_as_the_bf16_shard_within_rounding(tmp_path):
    g = torch.Generator().manual_seed(2)
    states = [(torch.randn(n, 24, generator=g).bfloat16(), torch.randn(n, 8, generator=g).bfloat16()) for n in (5, 7)]
    write_test_shard(tmp_path / "bf16.safetensors", states, "bfloat16")
    write_test_shard(tmp_path / "fp8.safetensors", states, FP8)
    assert read_shard_header(str(tmp_path / "fp8.safetensors"))["dtype"] == "F8_E4M3"
    assert (tmp_path / "fp8.safetensors").stat().st_size < (tmp_path / "bf16.safetensors").stat().st_size
    want_train, want_eval, _ = load_shards([str(tmp_path / "bf16.safetensors")])
    got_train, got_eval, ids = load_shards([str(tmp_path / "fp8.safetensors")])
    assert ids == [1, 2, 3]
    for got, want in zip(got_train + got_eval, want_train + want_eval, strict=True):
        assert got.input_ids.equal(want.input_ids) and got.loss_mask.equal(want.loss_mask)
        for field in ("hidden_states", "verifier_last_hidden_states"):
            a, b = getattr(got, field), getattr(want, field)
            assert a.shape == b.shape and not a.equal(b)
            assert torch.allclose(a, b, rtol=1 / 16, atol=b.abs().max().item() * 2**-9)


def test_stored_states_passes_unscaled_states_through():
    t = {"hidden_states": torch.ones(2, 4, dtype=torch.bfloat16)}
    assert stored_states(t, "hidden_states", torch.float32).dtype == torch.float32


def test_the_fp8_range_constant_is_torchs():
    from eagleflow.hidden_states.storage import FP8_MAX

    assert torch.finfo(torch.float8_e4m3fn).max == FP8_MAX
