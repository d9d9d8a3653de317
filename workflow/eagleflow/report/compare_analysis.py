"""The comparison report's numbers: each variant's headline figures, the learning-curve fit
and the k prediction. Pure functions, no I/O: report.compare reads the inputs and
report.compare_render writes them up.

Two models are stated in the report:
- Learning curve: mean acceptance length L against training conversations n, fitted as
  L = a + b·log2(n) by least squares; b is what doubling the data adds. With fewer than three
  points, or an interval on b that contains 0, the report says the points do not support a fit.
- The right k (chain drafting): a draft of k tokens is accepted up to its first rejection,
  and positions 1..k' behave the same whether k' or k tokens are drafted, so the
  per-position acceptance p_i of one run at k predicts L(k') = 1 + Σ_{i<k'} p_i for every
  k' ≤ k. Time per verifier step is modelled as T(k) = T_v + c·k: T_v = 1/B from the
  verifier alone (B tokens/s), c (drafting and verifying one more token) from the
  speculative run (S tokens/s): c = (L(k)/S − T_v)/k. Predicted speedup(k') = L(k')/(1 + c·k'/T_v).
"""

from __future__ import annotations

import math
from typing import Any

from eagleflow.benchmark.cells import HEADLINE
from eagleflow.common.exported_eval import exported_eval

# Two-sided 95% quantiles of Student's t for 1..10 degrees of freedom; 1.96 beyond.
T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228]


def variant_row(
    name: str, report: dict[str, Any], metrics: list[dict[str, Any]], train_s: float, size: int
) -> dict[str, Any]:
    """One variant's headline figures. Pure."""
    best = exported_eval(metrics)
    spec = report["speculative"]
    return {
        "variant": name,
        "method": report["method"],
        "k": report["num_speculative_tokens"],
        "mean_acceptance_length": spec["mean_acceptance_length"],
        "per_position_acceptance": spec["per_position_acceptance"],
        "training_estimate": best["estimated_acceptance_length"],
        "train_samples": best["train_samples"],
        "tokens_per_s": spec["output_tokens_per_s"],
        "baseline_tokens_per_s": report["baseline"]["output_tokens_per_s"],
        "speedup": report["speedup"],
        # A step with the draft (drafting, then verifying k + 1 tokens) against one of the verifier
        # alone: L tokens a step at S tokens/s, one at B. The draft's whole cost as served.
        "step_ratio": spec["mean_acceptance_length"] / report["speedup"],
        "baseline_measurement": report["baseline_measurement"],
        "train_s": train_s,
        "draft_mb": size / 1e6,
        # Every other set and temperature the benchmark measured (benchmark.sets, .temperatures).
        "set_lengths": {
            key: cell["speculative"]["mean_acceptance_length"]
            for key, cell in report["cells"].items()
            if key != HEADLINE
        },
    }


# --- learning curve --------------------------------------------------------------------------


def fit_learning_curve(points: list[tuple[int, float]]) -> dict[str, Any]:
    """Least-squares fit of L = a + b·log2(n) over (n, L) points. Pure.

    Returns {"fit": False, "why": ...} when the points do not support a fit, else the
    coefficients, b's standard error and 95% interval (what doubling n adds to L)."""
    pts = sorted(points)
    if len({n for n, _ in pts}) < 3:
        sizes = len({n for n, _ in pts})
        return {"fit": False, "why": f"{sizes} training size(s); a fit with an uncertainty needs at least 3"}
    xs = [math.log2(n) for n, _ in pts]
    ys = [y for _, y in pts]
    m = len(pts)
    xbar, ybar = sum(xs) / m, sum(ys) / m
    sxx = sum((x - xbar) ** 2 for x in xs)
    b = sum((x - xbar) * (y - ybar) for x, y in zip(xs, ys, strict=True)) / sxx
    a = ybar - b * xbar
    ssr = sum((y - (a + b * x)) ** 2 for x, y in zip(xs, ys, strict=True))
    se = math.sqrt(ssr / (m - 2) / sxx)
    t = T95[m - 3] if m - 2 <= len(T95) else 1.96
    low, high = b - t * se, b + t * se
    out = {"fit": True, "a": a, "b": b, "se": se, "low": low, "high": high, "points": m}
    if low <= 0 <= high:
        why = f"the slope {b:+.3f} per doubling has a 95% interval [{low:+.3f}, {high:+.3f}] that contains 0"
        out |= {"fit": False, "why": why}
    return out


# --- the right k -----------------------------------------------------------------------------


def per_token_cost(per_position: list[float], baseline_tps: float, speculative_tps: float) -> float:
    """c of the step-time model, in units of the verifier's step time T_v. Pure. Negative when
    the run with the draft took less time per step than the verifier alone, which the model
    cannot explain (the machine's speed changed between the two measurements)."""
    k = len(per_position)
    return ((1 + sum(per_position)) * baseline_tps / speculative_tps - 1) / k


def predict_k(per_position: list[float], baseline_tps: float, speculative_tps: float) -> list[dict[str, float]]:
    """Predicted mean acceptance length and speedup for k' = 1..k from one run at k. Pure."""
    k = len(per_position)
    c = max(0.0, per_token_cost(per_position, baseline_tps, speculative_tps))
    out = []
    for kk in range(1, k + 1):
        length = 1 + sum(per_position[:kk])
        out.append({"k": kk, "mean_acceptance_length": length, "speedup": length / (1 + c * kk)})
    return out
