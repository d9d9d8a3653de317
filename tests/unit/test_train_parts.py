import math

import pytest
import torch
import yaml

from eagleflow.common.config import typed
from eagleflow.train.config import TrainConfig
from eagleflow.train.data import Sample, collate, pack, shift
from eagleflow.train.methods import draft_method
from eagleflow.train.schedule import Schedule
from eagleflow.train.steps import lr_at
from tests.helpers import REPO

DEFAULT_TRAIN = yaml.safe_load((REPO / "config/config.yaml").read_text())["train"]


def test_shift_pairs_next_token_with_current_state():
    ids = torch.arange(10, 15)  # x0..x4
    g = torch.arange(5).float().unsqueeze(1) + 100  # g0..g4
    y = torch.arange(5).float().unsqueeze(1) + 200
    mask = torch.tensor([0, 0, 1, 1, 1]).bool()
    s = shift(ids, g, y, mask)
    assert s.input_ids.tolist() == [11, 12, 13, 14]
    assert s.hidden_states[:, 0].tolist() == [100, 101, 102, 103]
    assert s.verifier_last_hidden_states[:, 0].tolist() == [201, 202, 203, 204]
    assert s.loss_mask.tolist() == [False, True, True, True]


def mk(n):
    return Sample(torch.arange(n), torch.zeros(n, 6), torch.zeros(n, 2), torch.ones(n, dtype=torch.bool))


def test_pack_respects_budget_and_keeps_every_sample():
    samples = [mk(n) for n in (5, 3, 8, 2, 7, 1)]
    batches = pack(samples, 10, shuffle_seed=3)
    assert sorted(i for b in batches for i in b) == list(range(6))
    assert all(sum(len(samples[i]) for i in b) <= 10 for b in batches)
    assert pack(samples, 10, shuffle_seed=3) == batches


def test_a_step_takes_one_batch_a_rank_and_a_rank_without_one_stands_in_with_the_first():
    epochs = [[[0], [1], [2]], [[2], [0], [1]]]  # 3 batches an epoch: 2 steps on 2 ranks
    rank0, rank1 = Schedule(epochs, 2, 0), Schedule(epochs, 2, 1)
    assert rank0.total_steps == 4
    assert list(rank1.steps_from(0, 1)) == [(0, 1, 2), (1, 0, 2), (1, 1, 2)]  # resumed mid-epoch
    assert rank0.rank_batch((0, 0, 2)) == ([[0], [1]], True, [0])
    assert rank1.rank_batch((0, 0, 2)) == ([[0], [1]], True, [1])
    assert rank1.rank_batch((1, 1, 2)) == ([[1]], False, [1])  # no batch for rank 1: it stands in
    assert Schedule.packed([mk(5), mk(5)], 8, 0, 3, 1, 0).total_steps == 6


def test_collate_restarts_positions_and_numbers_documents():
    batch = collate([mk(3), mk(2)], batch_tokens=100)
    assert batch["position_ids"].tolist() == [[1, 2, 3, 1, 2]]
    assert batch["document_ids"].tolist() == [[0, 0, 0, 1, 1]]
    assert batch["hidden_states"].shape == (1, 5, 6)


@pytest.mark.parametrize(("schedule", "floor", "midway"), [("cosine", 0.1, 0.55), ("linear", 0.0, 0.5)])
def test_lr_warmup_then_decay_to_the_schedules_floor(schedule, floor, midway):
    assert lr_at(0, 100, 1.0, 10, schedule) == 0.1
    assert lr_at(9, 100, 1.0, 10, schedule) == 1.0
    assert lr_at(10, 100, 1.0, 10, schedule) == 1.0
    assert math.isclose(lr_at(55, 100, 1.0, 10, schedule), midway)
    assert math.isclose(lr_at(100, 100, 1.0, 10, schedule), floor, abs_tol=1e-12)
    assert lr_at(50, 100, 1.0, 10, schedule) < lr_at(30, 100, 1.0, 10, schedule)


def test_an_unknown_lr_schedule_is_refused_by_name():
    with pytest.raises(ValueError, match="train.lr_schedule: 'step'"):
        lr_at(50, 100, 1.0, 10, "step")


def test_summarise_estimates_acceptance_length():
    t = torch.tensor
    m = {"loss_sum": t(1.0), "num_batches": t(1.0)}
    for k, (full, cond) in enumerate([(8, 8), (4, 4), (2, 2)]):
        m |= {
            f"loss_{k}_sum": t(0.5),
            f"loss_{k}_total": t(1.0),
            f"full_acc_{k}_sum": t(float(full)),
            f"full_acc_{k}_total": t(10.0),
            f"cond_acc_{k}_sum": t(float(cond)),
            f"cond_acc_{k}_total": t(float(full) if k == 0 else 8.0),
        }
    cfg = typed(TrainConfig, {**DEFAULT_TRAIN, "ttt_steps": 3}, "train")
    out = draft_method("eagle3").summarise({k: float(v) for k, v in m.items()}, cfg)
    assert out["full_acc_0"] == 0.8 and out["full_acc_2"] == 0.2
    assert math.isclose(out["estimated_acceptance_length"], 1 + 0.8 + 0.4 + 0.2)
