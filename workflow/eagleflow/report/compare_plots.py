"""The comparison report's plots (report.compare): acceptance by variant, the
learning curve, the generate stage's concurrency limit, and the predicted speedup per k."""

from __future__ import annotations

import math
from typing import Any

from eagleflow.report.figures import pyplot, save_figure


def plot_acceptance_by_variant(rows: list[dict[str, Any]], out: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    width = 0.8 / len(rows)
    for i, r in enumerate(rows):
        xs = [p + i * width for p in range(len(r["per_position_acceptance"]))]
        ax.bar(xs, r["per_position_acceptance"], width, label=f"{r['variant']} (L={r['mean_acceptance_length']:.2f})")
    k = max(len(r["per_position_acceptance"]) for r in rows)
    ax.set_xticks([p + 0.4 - width / 2 for p in range(k)], [f"pos {p + 1}" for p in range(k)])
    ax.set_ylim(0, 1)
    ax.set_ylabel("accepted / drafts")
    ax.set_title("Per-position acceptance per variant (vLLM)")
    ax.legend(fontsize=8)
    save_figure(fig, out)


def plot_learning_curve(curve: list[dict[str, Any]], fit: dict[str, Any], out: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    ns = [r["train_samples"] for r in curve]
    ax.plot(ns, [r["mean_acceptance_length"] for r in curve], "o", label="measured (vLLM)")
    if fit.get("a") is not None and len(ns) > 1:
        grid = [min(ns) * (2 * max(ns) / min(ns)) ** (i / 40) for i in range(41)]
        ax.plot(grid, [fit["a"] + fit["b"] * math.log2(n) for n in grid], "-", label="a + b·log2(n)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("training samples")
    ax.set_ylabel("mean acceptance length")
    ax.set_title("Learning curve" if len(ns) > 1 else "Learning curve (one point: no curve)")
    ax.legend(fontsize=8)
    save_figure(fig, out)


def plot_concurrency(limit: dict[str, Any] | None, out: str) -> None:
    """The limit and the requests in flight over the last generate job (a step plot)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 3.0))
    trace = (limit or {}).get("trace") or []
    if len(trace) > 1:
        ts = [t for t, _, _ in trace]
        ax.step(ts, [c for _, c, _ in trace], where="post", label="limit")
        ax.step(ts, [n for _, _, n in trace], where="post", alpha=0.6, label="in flight (at changes)")
        ax.axhline(limit["ceiling"], color="grey", linestyle="--", label=f"ceiling {limit['ceiling']}")
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no request sent in the last generate job", ha="center", va="center")
    ax.set_xlabel("seconds into the generate job")
    ax.set_ylabel("requests")
    ax.set_title("Generate: concurrency over time")
    save_figure(fig, out)


def plot_k(
    predictions: list[dict[str, float]],
    source: dict[str, Any],
    checks: list[tuple[dict[str, Any], dict[str, float]]],
    out: str,
) -> None:
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.2))
    ks = [p["k"] for p in predictions]
    ax1.plot(ks, [p["mean_acceptance_length"] for p in predictions], "o-", label=f"predicted from k={source['k']}")
    ax2.plot(ks, [p["speedup"] for p in predictions], "o-", label=f"predicted from k={source['k']}")
    for run, _ in checks:
        ax1.plot([run["k"]], [run["mean_acceptance_length"]], "s", label=f"measured ({run['variant']})")
        ax2.plot([run["k"]], [run["speedup"]], "s", label=f"measured ({run['variant']})")
    ax1.set_xlabel("speculative tokens k")
    ax1.set_ylabel("mean acceptance length")
    ax2.set_xlabel("speculative tokens k")
    ax2.set_ylabel("speedup")
    ax2.axhline(1.0, color="grey", linestyle="--")
    ax1.legend(fontsize=8)
    ax2.legend(fontsize=8)
    save_figure(fig, out)
