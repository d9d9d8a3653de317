"""Training reads hidden-state shards per batch: refs up front, each sample's states when a
batch asks for it (the next step's while a step runs), and bad shards refused by name before
any step."""

import shutil
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from devkit.train_inputs import make_train_inputs
from eagleflow.train.data import ShardSamples, read_ahead

TRAIN_LENGTHS = [12, 9, 15, 7, 11]
EVAL_LENGTHS = [10, 8]


@pytest.fixture(scope="module")
def inputs(tiny_llama_dir, tmp_path_factory):
    return make_train_inputs(
        tmp_path_factory.mktemp("reader-inputs"), tiny_llama_dir, TRAIN_LENGTHS, EVAL_LENGTHS, draft_vocab=64
    )


def test_refs_hold_no_states_and_read_each_samples_own_slice_shifted(inputs):
    source = ShardSamples(inputs["shards"])
    train, evals = source.refs()
    assert sorted(len(r) + 1 for r in train) == sorted(TRAIN_LENGTHS)
    assert sorted(len(r) + 1 for r in evals) == sorted(EVAL_LENGTHS)
    assert all(isinstance(v, int) for r in train + evals for v in vars(r).values())
    # Each ref's sample against the shard's tensors cut at its offsets and shifted by hand.
    whole = {path: load_file(path) for path in inputs["shards"]}
    for ref, got in zip(train + evals, source.samples(train + evals), strict=True):
        t = whole[inputs["shards"][ref.shard]]
        a, b = t["offsets"][ref.index].item(), t["offsets"][ref.index + 1].item()
        assert torch.equal(got.input_ids, t["input_ids"][a + 1 : b].long())
        assert torch.equal(got.loss_mask, t["loss_mask"][a + 1 : b].bool())
        assert torch.equal(got.hidden_states, t["hidden_states"][a : b - 1].float())
        assert torch.equal(got.verifier_last_hidden_states, t["verifier_last_hidden_states"][a + 1 : b].float())
        assert got.hidden_states.dtype == torch.float32


def test_a_training_fraction_keeps_every_eval_sample_and_fewer_train_samples(inputs):
    source = ShardSamples(inputs["shards"])
    all_train, all_evals = source.refs(1.0)
    some_train, some_evals = source.refs(0.3)
    assert some_evals == all_evals
    assert set(some_train) < set(all_train)


def test_a_truncated_shard_is_refused_by_name_before_training(inputs, tmp_path):
    bad = tmp_path / "shard-00001.safetensors"
    data = Path(inputs["shards"][1]).read_bytes()
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"shard-00001\.safetensors: not a readable hidden-state shard.*rerun"):
        ShardSamples([inputs["shards"][0], str(bad)])


def test_shards_of_other_aux_layers_are_refused(inputs, tmp_path):
    other = tmp_path / "other.safetensors"
    shutil.copy(inputs["shards"][1], other)
    with safe_open(str(other), framework="pt") as f:
        metadata = f.metadata()
    save_file(load_file(str(other)), str(other), {**metadata, "aux_layer_ids": "[0, 1, 2]"})
    with pytest.raises(ValueError, match=r"other\.safetensors: aux_layer_ids \[0, 1, 2\] differ"):
        ShardSamples([inputs["shards"][0], str(other)])


def test_read_ahead_reads_the_next_item_while_the_caller_works_on_this_one():
    started = {k: threading.Event() for k in range(6)}

    def read(k):
        started[k].set()
        return k * k

    got = []
    for k, value in read_ahead(range(6), read):
        got.append((k, value))
        if k < 5:  # the next read runs now, in the background; one more never does
            assert started[k + 1].wait(timeout=30)
        assert not any(started[m].is_set() for m in range(k + 2, 6))
    assert got == [(k, k * k) for k in range(6)]
    assert list(read_ahead(range(6), lambda k: k * k, ahead=False)) == got


def test_read_ahead_raises_a_reads_error_where_its_item_would_come():
    def read(k):
        if k == 3:
            raise ValueError("shard-00003.safetensors: not a readable hidden-state shard")
        return k

    got = []
    with pytest.raises(ValueError, match="shard-00003"):
        for k, _ in read_ahead(range(6), read):
            got.append(k)
    assert got == [0, 1, 2]
