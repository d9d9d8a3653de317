"""What training settles before its first step, without training: the attention and loss
implementations a device gets, the fused loss's autotune configs, the steps an epoch takes,
and the fingerprint that says which checkpoints a run may resume."""

import json
import os
from pathlib import Path

import pytest
import torch

from devkit.train_inputs import make_train_inputs
from eagleflow.train.device import resolve_impls, untie_fused_loss_autotuners
from eagleflow.train.fingerprint import training_fingerprint
from eagleflow.train.steps import steps_in
from tests.helpers import TINY_EVAL_LENGTHS, TINY_TRAIN_CFG, TINY_TRAIN_LENGTHS

CFG = TINY_TRAIN_CFG


@pytest.fixture(scope="module")
def inputs(tiny_llama_dir, tmp_path_factory):
    return make_train_inputs(
        tmp_path_factory.mktemp("train-inputs"), tiny_llama_dir, TINY_TRAIN_LENGTHS, TINY_EVAL_LENGTHS, draft_vocab=64
    )


def test_resolve_impls_auto_and_refusals():
    assert resolve_impls("auto", "auto", cuda=False, triton=True) == ("doc_sdpa", "eager")
    assert resolve_impls("auto", "auto", cuda=True, triton=True) == ("simple_flex_attention", "fused")
    assert resolve_impls("auto", "auto", cuda=True, triton=False) == ("simple_flex_attention", "eager")
    assert resolve_impls("eager", "eager", cuda=True, triton=True) == ("eager", "eager")
    with pytest.raises(ValueError, match="attn_impl"):
        resolve_impls("simple_flex_attention", "eager", cuda=False, triton=False)
    with pytest.raises(ValueError, match="loss_implementation"):
        resolve_impls("sdpa", "fused", cuda=False, triton=True)


def test_fused_loss_kernels_get_a_configs_list_each():
    """speculators' fused loss shares one autotune configs list between its forward and backward
    kernels; Dynamo refuses that inside the compiled draft forward (seen on an H200)."""
    from speculators.losses import fused

    untie_fused_loss_autotuners()
    forward, backward = fused.loss_forward_kernel.configs, fused.loss_backward_kernel.configs
    assert forward is not backward
    assert [c.kwargs for c in forward] == [c.kwargs for c in backward] and forward


def test_steps_in_rounds_up():
    assert [steps_in(n, 2) for n in (1, 2, 3, 4)] == [1, 1, 2, 2]
    assert steps_in(5, 1) == 5


def test_fingerprint_tracks_what_determines_training(inputs, tmp_path):
    fp = training_fingerprint(CFG, inputs["index"], inputs["vocab_map"], inputs["shards"], "code1")
    assert fp == training_fingerprint(
        dict(reversed(CFG.items())), inputs["index"], inputs["vocab_map"], inputs["shards"], "code1"
    )
    assert fp == training_fingerprint(
        {**CFG, "checkpoint_every": 7, "keep_checkpoints": 1},
        inputs["index"],
        inputs["vocab_map"],
        inputs["shards"],
        "code1",
    )
    assert fp != training_fingerprint(
        {**CFG, "lr": 0.001}, inputs["index"], inputs["vocab_map"], inputs["shards"], "code1"
    )
    assert fp != training_fingerprint(
        {**CFG, "nproc_per_node": 2}, inputs["index"], inputs["vocab_map"], inputs["shards"], "code1"
    )
    assert fp != training_fingerprint(CFG, inputs["index"], inputs["vocab_map"], inputs["shards"], "code2")
    index = json.loads(Path(inputs["index"]).read_text())
    other_index = tmp_path / "index.json"

    def key_with(**changes):
        other_index.write_text(json.dumps(index | changes))
        return training_fingerprint(CFG, str(other_index), inputs["vocab_map"], inputs["shards"], "code1")

    assert fp != key_with(aux_layer_ids=[0, 1, 2]) and fp != key_with(num_tokens=index.get("num_tokens", 0) + 1)
    # Where the files and the verifier were, which backend wrote them and under which store key
    # do not count: the samples' content digests say whether the data is the same.
    moved = [{**s, "file": f"elsewhere/{s['file']}", "key": "another"} for s in index["samples"]]
    assert fp == key_with(verifier="/elsewhere/verifier", backends=["other"], samples=moved)
    assert fp != key_with(samples=[{**index["samples"][0], "digest": "other states"}, *index["samples"][1:]])
    assert fp != training_fingerprint(CFG, inputs["index"], inputs["vocab_map"], inputs["shards"][:1], "code1")
    # A shard is what it holds (the content digest in its header): linked back with a fresh
    # mtime, or extracted again under another key with the same states, it is the same shard;
    # with other states it is another. The verifier's content counts too.
    from eagleflow.hidden_states.shard_file import ShardMeta, write_shard

    shard = tmp_path / "shard-00000.safetensors"
    sample = {"id": "a", "split": "train", "input_ids": [1, 2], "loss_mask": [1, 1]}
    states = [(torch.zeros(2, 6), torch.zeros(2, 2))]
    write_shard(shard, [sample], states, ShardMeta(["a"], [0, 1, 2], 3, 2, made_from="k1"))
    keyed = training_fingerprint(CFG, inputs["index"], inputs["vocab_map"], [str(shard)], "code1")
    os.utime(shard, (1, 1))
    assert keyed == training_fingerprint(CFG, inputs["index"], inputs["vocab_map"], [str(shard)], "code1")
    write_shard(shard, [sample], states, ShardMeta(["a"], [0, 1, 2], 3, 2, backend="vllm", made_from="k2"))
    assert keyed == training_fingerprint(CFG, inputs["index"], inputs["vocab_map"], [str(shard)], "code1")
    write_shard(shard, [sample], [(torch.ones(2, 6), torch.zeros(2, 2))], ShardMeta(["a"], [0, 1, 2], 3, 2))
    assert keyed != training_fingerprint(CFG, inputs["index"], inputs["vocab_map"], [str(shard)], "code1")
    assert keyed != training_fingerprint(
        CFG, inputs["index"], inputs["vocab_map"], [str(shard)], "code1", verifier="another verifier"
    )
