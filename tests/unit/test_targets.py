"""The compact target (hidden_states.target: topk): the verifier's top-k logits from its final
state, stored in a shard, read back in the draft vocabulary, and made into the dense targets
training's loss takes."""

import pytest
import torch

from eagleflow.common.config import ConfigError, load_config, validate_config
from eagleflow.hidden_states.index import write_index
from eagleflow.hidden_states.shard_file import ShardMeta, read_shard_header, write_shard
from eagleflow.hidden_states.storage import num_stored_states, shard_bytes, token_bytes
from eagleflow.hidden_states.targets import FILL, TopkHead, dense_targets, draft_index
from eagleflow.train.data import collate, load_shards
from eagleflow.train.steps import to_device


def test_topk_head_gives_the_verifiers_own_largest_logits(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    with torch.no_grad():  # a final norm that is not all ones: forgetting it would show
        model.model.norm.weight.copy_(torch.rand(model.config.hidden_size, generator=torch.Generator().manual_seed(0)))
    model.save_pretrained(tiny_llama_dir.parent / "normed")
    final = torch.randn(50, model.config.hidden_size, generator=torch.Generator().manual_seed(1)) * 3
    head = TopkHead(str(tiny_llama_dir.parent / "normed"), k=10)
    ids, logits = head(final)
    assert ids.dtype == torch.int32 and logits.dtype == torch.float16 and ids.shape == logits.shape == (50, 10)
    with torch.no_grad():
        want = model.lm_head(model.model.norm(final)).topk(10)
    assert ids.long().equal(want.indices)
    assert torch.allclose(logits.float(), want.values - want.values[:, :1], atol=2e-3)
    assert (logits[:, 0] == 0).all() and (logits <= 0).all()


def test_dense_targets_keep_the_softmax_on_the_draft_vocabulary():
    g = torch.Generator().manual_seed(2)
    vocab = 40
    logits = torch.randn(6, vocab, generator=g) * 4
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[torch.randperm(vocab, generator=g)[:16]] = True
    index = draft_index(t2d)
    assert index[t2d].tolist() == list(range(16)) and (index[~t2d] == -1).all()
    # All of the vocabulary kept: the same distribution training builds from the final state.
    top = logits.topk(vocab)
    dense = dense_targets(index[top.indices], top.values - top.values[:, :1], 16)
    assert torch.allclose(dense.softmax(-1), logits[:, t2d].softmax(-1), atol=1e-6)
    # The top 8 only: the draft-vocabulary ids among them, renormalised; nothing else has mass.
    top = logits.topk(8)
    dense = dense_targets(index[top.indices], top.values, 16)
    kept = torch.full((6, vocab), float("-inf"))
    kept.scatter_(1, top.indices, top.values)
    want = kept[:, t2d]
    has_any = want.isfinite().any(-1)
    assert torch.allclose(dense[has_any].softmax(-1), want[has_any].softmax(-1), atol=1e-6)
    assert (dense[~has_any] == FILL).all()


def write_compact_shard(path, k: int = 3):
    samples = [
        {"id": "p0#t0", "split": "train", "input_ids": list(range(5)), "loss_mask": [0, 0, 1, 1, 1]},
        {"id": "p1#t0", "split": "eval", "input_ids": list(range(7)), "loss_mask": [0, 1, 1, 1, 1, 1, 1]},
    ]
    g = torch.Generator().manual_seed(3)
    states = [(torch.randn(n, 24, generator=g).bfloat16(), torch.randn(n, 8, generator=g).bfloat16()) for n in (5, 7)]
    # Verifier vocabulary of 20; token 3 of the first sample has only ids outside the draft vocabulary.
    targets = []
    for n in (5, 7):
        ids = torch.stack([torch.randperm(10, generator=g)[:k] * 2 for _ in range(n)]).to(torch.int32)
        targets.append((ids, -torch.rand(n, k, generator=g).sort(-1, descending=True).values.half()))
    targets[0][0][3] = torch.tensor([1, 3, 5][:k], dtype=torch.int32)
    meta = ShardMeta([s["id"] for s in samples], [1, 2, 3], num_layers=6, hidden_size=8)
    write_shard(path, samples, states, meta, "bfloat16", targets)
    return samples, states, targets


def test_a_compact_shard_reads_back_in_the_draft_vocabulary(tmp_path):
    path = tmp_path / "shard-00000.safetensors"
    samples, states, targets = write_compact_shard(path)
    header = read_shard_header(str(path))
    assert header["target_topk"] == 3
    # On disk: what the plan counts (3 aux states, no final state, 3 logits per token).
    want = shard_bytes(12, 2, num_stored_states(3, 3), 8, "bfloat16", 3)
    assert 0 <= path.stat().st_size - want < 1024
    with pytest.raises(ValueError, match="pass t2d"):
        load_shards([str(path)])
    t2d = torch.zeros(20, dtype=torch.bool)
    t2d[::2] = True  # the even ids: draft index id // 2
    train, evals, _ = load_shards([str(path)], t2d=t2d)
    (s,) = train
    assert s.verifier_last_hidden_states is None
    # Shifted by one (train.data.shift): position t holds the target of token t + 1.
    assert s.target_ids.equal(torch.where(targets[0][0][1:] % 2 == 0, targets[0][0][1:] // 2, -1).long())
    assert s.target_logits.equal(targets[0][1][1:].float())
    # Token 3 has no draft-vocabulary target: it leaves the loss; the others keep their mask.
    assert s.loss_mask.tolist() == [False, True, False, True]
    assert evals[0].loss_mask.tolist() == [True] * 6
    # Into the model's layout: dense logits on the draft vocabulary in the final state's place.
    batch = collate(train + evals, 64)
    assert "verifier_last_hidden_states" not in batch and batch["target_ids"].shape == (1, 10, 3)
    model = torch.nn.Module()
    model.lm_head = torch.nn.Linear(8, 10, bias=False)
    inputs = to_device(batch, torch.device("cpu"), model)
    dense = inputs["verifier_last_hidden_states"]
    assert dense.shape == (1, 10, 10) and "target_ids" not in inputs
    # Token 1's first pair, at its draft index; ids outside the draft vocabulary get no logit.
    assert dense[0, 0, targets[0][0][1, 0] // 2] == targets[0][1][1, 0].float()
    assert (dense[0, 2] == FILL).all()


def test_an_index_over_mixed_targets_is_refused(tmp_path):
    write_compact_shard(tmp_path / "a.safetensors")
    samples = [{"id": "p2#t0", "split": "train", "input_ids": [1, 2], "loss_mask": [1, 1]}]
    states = [(torch.zeros(2, 24).bfloat16(), torch.zeros(2, 8).bfloat16())]
    write_shard(tmp_path / "b.safetensors", samples, states, ShardMeta(["p2#t0"], [1, 2, 3], 6, 8))
    with pytest.raises(ValueError, match="target_topk"):
        write_index([str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")], "v", str(tmp_path / "i.json"))


def test_compact_target_bytes_for_kimi_k25():
    # 3 aux states of 7168 in bf16, and the top 64 logits instead of the final state.
    full = token_bytes(num_stored_states(3, 0), 7168, "bfloat16")
    compact = token_bytes(num_stored_states(3, 64), 7168, "bfloat16", 64)
    assert full - compact == 7168 * 2 - 64 * 6
    assert compact / full == pytest.approx(0.76, abs=0.01)


def test_online_mode_refuses_the_compact_target(tmp_path):
    from tests.helpers import REPO

    config = load_config(REPO / "config/config.yaml")
    config["hidden_states"] |= {"target": "topk"}
    validate_config(config)
    config["hidden_states"] |= {"mode": "online"}
    with pytest.raises(ConfigError, match="target: topk"):
        validate_config(config)
