import numpy as np
import pytest

from eagleflow.vocab import build_vocab_map, coverage, coverage_curve, curve_sizes, token_counts


def test_counts_only_loss_masked_tokens():
    counts = token_counts([[1, 2, 3, 3], [3, 4]], [[0, 1, 1, 1], [0, 1]], vocab_size=6)
    assert counts.tolist() == [0, 0, 1, 2, 1, 0]


def test_mapping_follows_the_speculators_vllm_convention():
    counts = np.array([0, 9, 1, 7, 0, 8, 2, 0])
    d2t, t2d = build_vocab_map(counts, draft_vocab_size=4)
    chosen = (np.arange(4) + d2t.numpy()).tolist()
    assert chosen == [1, 3, 5, 6]  # the 4 most frequent, in ascending verifier-id order
    assert t2d.tolist() == [False, True, False, True, False, True, True, False]
    assert d2t.dtype.is_floating_point is False and str(d2t.dtype) == "torch.int64"
    assert str(t2d.dtype) == "torch.bool"


def test_ties_break_to_lower_ids_and_unseen_tokens_fill_up():
    d2t, t2d = build_vocab_map(np.array([0, 1, 0, 0, 1]), draft_vocab_size=3)
    assert (np.arange(3) + d2t.numpy()).tolist() == [0, 1, 4]


def test_coverage():
    counts = np.array([5, 3, 2])
    _, t2d = build_vocab_map(counts, 1)
    assert coverage(counts, t2d) == 0.5


def test_rejects_bad_draft_vocab_size():
    with pytest.raises(ValueError, match="draft_vocab_size"):
        build_vocab_map(np.zeros(4, dtype=np.int64), 5)


def test_coverage_curve_agrees_with_the_map_at_every_size():
    rng = np.random.default_rng(0)
    train = rng.zipf(1.5, 2000) % 300
    evals = rng.zipf(1.5, 500) % 300
    train_counts, eval_counts = np.bincount(train, minlength=300), np.bincount(evals, minlength=300)
    curve = coverage_curve(train_counts, eval_counts, [1, 10, 64, 299, 300])
    for point in curve:
        _, t2d = build_vocab_map(train_counts, point["size"])
        assert point["train"] == pytest.approx(coverage(train_counts, t2d))
        assert point["eval"] == pytest.approx(coverage(eval_counts, t2d))
    assert [p["train"] for p in curve] == sorted(p["train"] for p in curve) and curve[-1]["train"] == 1.0


def test_curve_sizes_include_the_configured_size_and_the_whole_vocab():
    assert curve_sizes(1000, 300) == [64, 128, 256, 300, 512, 1000]
