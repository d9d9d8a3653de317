"""The plan's hours through a bucket (dag/plan/bucket.py)."""

import pytest

from eagleflow.dag.plan.bucket import bucket_rows, link_hours

GB = 1e9


def config(cache_gb: float) -> dict:
    return {"storage": {"cache_gb": cache_gb}}


def draft(epochs: int = 3, nproc: int = 8) -> dict:
    return {"": ({"method": "eagle3", "epochs": epochs, "sample_fraction": 1.0, "nproc_per_node": nproc}, 1024)}


def test_ten_gigabits_move_4500_gb_an_hour():
    assert link_hours(4500 * GB, 10) == pytest.approx(1.0)


def test_training_reads_the_states_each_epoch_unless_the_caches_hold_them():
    small, held = (bucket_rows(config(c), 100 * GB, 800 * GB, draft(), {"": GB}, {"": 1.0}, 10) for c in (1, 100))
    assert [r["down"] for r in small] == [0, 2400 * GB] and small[1]["up"] == GB
    assert held[1]["down"] == 800 * GB  # 8 processes x 100 GB hold all 800 GB: one pass
    assert small[0]["hours"] == pytest.approx(link_hours(100 * GB, 10))


def test_the_note_says_whether_the_link_keeps_up_with_training():
    slow = bucket_rows(config(1), 0, 4500 * GB, draft(epochs=1), {"": 0}, {"": 0.5}, 10)[1]
    fast = bucket_rows(config(1), 0, 4500 * GB, draft(epochs=1), {"": 0}, {"": 2.0}, 10)[1]
    assert "waits on the link, 0.5 h at least" in slow["note"] and "storage.cache_gb 562" in slow["note"]
    assert "the link keeps up" in fast["note"]


def test_each_checkpoint_is_uploaded_beside_the_draft():
    plain, checkpointed = (
        bucket_rows(config(1), 0, 800 * GB, draft(), {"": GB}, {"": 1.0}, 10, ckpt)[1]
        for ckpt in (None, {"": (4, 3 * GB)})
    )
    assert plain["up"] == GB and "checkpoints" not in plain["what"]
    assert checkpointed["up"] == 13 * GB and "4 checkpoints of 3.0 GB copied" in checkpointed["what"]
    assert checkpointed["hours"] == pytest.approx(link_hours(13 * GB + 2400 * GB, 10))
