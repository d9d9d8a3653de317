"""The comparison report's models: the learning-curve fit and the k prediction, and the report."""

import math

import pytest

from eagleflow.report.compare import run_compare
from eagleflow.report.compare_analysis import fit_learning_curve, predict_k, variant_row
from eagleflow.report.compare_render import recommend_k


def test_a_clean_log_curve_is_recovered_with_a_tight_interval():
    pts = [(n, 1.2 + 0.1 * math.log2(n) + e) for n, e in ((100, 0.002), (200, -0.001), (400, 0.001), (800, -0.002))]
    fit = fit_learning_curve(pts)
    assert fit["fit"] and fit["b"] == pytest.approx(0.1, abs=0.005) and fit["low"] < 0.1 < fit["high"]


def test_points_that_do_not_support_a_fit_say_so():
    assert not fit_learning_curve([(100, 1.3), (200, 1.4)])["fit"]  # two sizes: no uncertainty
    noisy = fit_learning_curve([(100, 1.5), (200, 1.3), (400, 1.52)])
    assert not noisy["fit"] and "contains 0" in noisy["why"]


def test_k_prediction_is_chain_drafting_with_a_linear_step_cost():
    p = [0.5, 0.3, 0.1]
    # Verifier alone 100 tok/s (T_v = 10 ms); with k=3, L = 1.9 at 95 tok/s: c = (1.9/95 - 0.01)/3.
    pred = predict_k(p, 100.0, 95.0)
    assert [x["mean_acceptance_length"] for x in pred] == pytest.approx([1.5, 1.8, 1.9])
    c = (1.9 / 95 - 0.01) / 3
    assert pred[2]["speedup"] == pytest.approx(0.95)  # the measured point is reproduced
    assert pred[0]["speedup"] == pytest.approx(1.5 / (1 + c / 0.01))
    assert "Recommended: k=1" in recommend_k(pred)
    assert "No k is predicted" in recommend_k(predict_k([0.1, 0.05], 100.0, 60.0))


def row(name, k, per_pos, samples, tps=50.0, set_lengths=None):
    return {
        "variant": name,
        "method": "eagle3",
        "k": k,
        "mean_acceptance_length": 1 + sum(per_pos),
        "per_position_acceptance": per_pos,
        "training_estimate": 1.9,
        "train_samples": samples,
        "tokens_per_s": tps,
        "baseline_tokens_per_s": 55.0,
        "speedup": tps / 55.0,
        "step_ratio": (1 + sum(per_pos)) * 55.0 / tps,
        "baseline_measurement": "the run's baseline job (baseline/report.json)",
        "train_s": 120.0,
        "draft_mb": 12.5,
        "set_lengths": set_lengths or {},
    }


# generate's stats.json, as run_generate writes it (trace: [seconds, limit, in flight]).
LOADS = {"generate": {"start": 2, "restart": 1}, "hidden_states": {"start": 1}, "baseline": {"start": 1}}
GENERATE = {
    "requests": 30,
    "sent": 20,
    "reused": 10,
    "failed_conversations": 0,
    "server_restarts": 1,
    "wall_s": 12.5,
    "concurrency": {
        "adaptive": True,
        "ceiling": 16,
        "final": 6,
        "decreases": 1,
        "server_preemptions": 2,
        "started_at": 0.0,
        "trace": [[0.0, 4, 0], [1.0, 8, 8], [2.0, 12, 12], [3.0, 6, 12], [5.0, 6, 0]],
    },
}


def test_the_report_carries_the_table_the_curve_and_the_k_check(tmp_path):
    rows = [
        row("default", 3, [0.4, 0.2, 0.1], 400, set_lengths={"mt_bench@T0": 1.45, "mt_bench@T0.7": 1.3}),
        row("lc-25", 3, [0.3, 0.1, 0.05], 100, set_lengths={"mt_bench@T0": 1.25}),
        row("lc-50", 3, [0.35, 0.15, 0.07], 200),
        row("k2", 2, [0.4, 0.2], 400, tps=52.0),
    ]
    out = {
        k: str(tmp_path / f"{k}.{'md' if k == 'md' else 'html' if k == 'html' else 'png'}")
        for k in ("md", "html", "acceptance_png", "learning_curve_png", "k_png", "concurrency_png")
    }
    run_compare(rows, ["lc-25", "lc-50"], ["k2"], out, GENERATE, LOADS)
    md = (tmp_path / "md.md").read_text()
    assert "Speedups are against the verifier alone: the run's baseline job (baseline/report.json)." in md
    assert "| default | eagle3 | 3 | 1.700 | 0.400 / 0.200 / 0.100 |" in md
    assert "- mean acceptance length: `default` (eagle3, k=3) 1.700 > `k2` (eagle3, k=2) 1.600 > `lc-50`" in md
    assert "- speedup: `k2` (eagle3, k=2) 0.95x > `default` (eagle3, k=3) 0.91x" in md
    # A column per other set and temperature; empty where a variant did not measure it.
    assert "| mean acceptance length, mt_bench@T0 | mean acceptance length, mt_bench@T0.7 |" in md
    assert "| 120 s | 12.5 MB | 1.450 | 1.300 |" in md and "| 120 s | 12.5 MB | 1.250 |  |" in md
    assert "Doubling the training conversations (400 → 800)" in md or "do not support a fit" in md
    assert "Check against variant `k2` measured at k=2: mean acceptance length 1.600 measured vs 1.600 predicted" in md
    assert "30 requests: 20 sent to the verifier, 10 answered by the response store" in md
    assert "1 server restart(s)" in md and "adaptive, ceiling 16: 1 decrease(s), ended at 6" in md
    assert "![generate concurrency](concurrency_png.png)" in md
    assert "| generate | 2 | 1 |" in md and "| hidden_states | 1 | 0 |" in md and "| total | 5 | |" in md
    for name in ("acceptance_png", "learning_curve_png", "k_png", "concurrency_png"):
        assert (tmp_path / f"{name}.png").read_bytes()[:4] == b"\x89PNG"


def test_a_draft_run_faster_per_step_than_the_verifier_alone_is_flagged(tmp_path):
    """L=1.1 at 80 tok/s against 55 tok/s alone: a step took less time with the draft."""
    out = {
        k: str(tmp_path / f"{k}.x")
        for k in ("md", "html", "acceptance_png", "learning_curve_png", "k_png", "concurrency_png")
    }
    run_compare([row("default", 3, [0.1, 0.0, 0.0], 400, tps=80.0)], [], [], out, GENERATE, LOADS)
    assert "Caution: with the draft, a verifier step took less time" in (tmp_path / "md.x").read_text()
    out2 = {k: str(tmp_path / f"b{k}.x") for k in out}
    run_compare([row("default", 3, [0.4, 0.2, 0.1], 400, tps=50.0)], [], [], out2, GENERATE, LOADS)
    assert "Caution" not in (tmp_path / "bmd.x").read_text()


def test_a_variants_row_carries_its_method_and_the_step_time_its_draft_costs():
    """A step with the draft makes L tokens at S tokens/s, one of the verifier alone 1 at B:
    the step costs L * B / S of the verifier's, whatever the method drafted."""
    report = {
        "method": "dflash",
        "num_speculative_tokens": 7,
        "speculative": {
            "mean_acceptance_length": 1.5,
            "per_position_acceptance": [0.3] * 7,
            "output_tokens_per_s": 45.0,
        },
        "baseline": {"output_tokens_per_s": 50.0},
        "speedup": 0.9,
        "baseline_measurement": "the run's baseline job",
        "cells": {},
    }
    metrics = [{"split": "eval", "step": 10, "loss": 1.0, "estimated_acceptance_length": 1.8, "train_samples": 300}]
    row = variant_row("dflash", report, metrics, 60.0, 10**7)
    assert row["method"] == "dflash" and row["k"] == 7
    assert row["step_ratio"] == pytest.approx(1.5 * 50.0 / 45.0)
