"""The variant report's plots (report.variant): acceptance per position, acceptance by
context length, training curves, data quality, vocabulary coverage, the training prompts."""

from __future__ import annotations

from typing import Any

from eagleflow.common.defects import EXCLUDING
from eagleflow.report.figures import pyplot, save_figure


def plot_acceptance(report: dict[str, Any], out: str, parity: dict[str, Any] | None = None) -> None:
    """vLLM's per-position acceptance; next to it, with a parity report, the replay's."""
    plt = pyplot()
    per_pos = report["speculative"]["per_position_acceptance"]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    labels = [f"pos {i + 1}" for i in range(len(per_pos))]
    if parity is None or parity.get("replay") is None:
        ax.bar_label(ax.bar(labels, per_pos, color="#3b6ea8"), fmt="%.2f")
    else:
        x = range(len(per_pos))
        replay = parity["replay"]["per_position_acceptance"]
        ax.bar_label(ax.bar([i - 0.2 for i in x], per_pos, 0.4, color="#3b6ea8", label="vLLM"), fmt="%.2f")
        ax.bar_label(ax.bar([i + 0.2 for i in x], replay, 0.4, color="#e0a040", label="replay"), fmt="%.2f")
        ax.set_xticks(list(x), labels)
        ax.legend()
    ax.set_ylim(0, 1)
    ax.set_ylabel("accepted / drafts")
    ax.set_title(f"Per-position acceptance (mean length {report['speculative']['mean_acceptance_length']:.2f})")
    save_figure(fig, out)


def bucket_label(lo: int, hi: int, last: bool) -> str:
    """`512-1024` (`2048+` for the last bucket, which also takes longer contexts). Pure."""
    return f"{lo}+" if last else f"{lo}-{hi}"


# A bucket's mean from fewer drafts is noise on a plot (one draft of 4 accepted tokens is a
# point at 4.0); the table still shows it, with the count over all sets.
MIN_PLOTTED_DRAFTS = 20


def plot_context(parity: dict[str, Any] | None, out: str) -> None:
    """Mean acceptance length by the context length a draft was proposed at, per set and over
    all (the parity replay's buckets, those of MIN_PLOTTED_DRAFTS drafts or more), with the
    longest context the draft was trained on."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    if parity is None or "context" not in parity:
        ax.text(0.5, 0.5, "no parity job: acceptance by context length\ncomes from its replay", ha="center")
        ax.set_axis_off()
        save_figure(fig, out)
        return
    context = parity["context"]
    edges = context["edges"]
    mids = [(hi / 2 if lo == 0 else (lo * hi) ** 0.5) for lo, hi in zip(edges, edges[1:], strict=False)]
    series = {**context["sets"], "all sets": context["all"]}
    for name, rows in series.items():
        points = [
            (x, r["mean_acceptance_length"])
            for x, r in zip(mids, rows, strict=True)
            if r["num_drafts"] >= MIN_PLOTTED_DRAFTS
        ]
        if points:
            bold = (
                {"linewidth": 2.5, "color": "black", "zorder": 1}
                if name == "all sets"
                else {"linewidth": 1, "zorder": 2}
            )
            ax.plot(*zip(*points, strict=True), "o-", markersize=4, label=name, **bold)
    trained = context["trained"]
    if trained.get("longest_sample"):
        ax.axvline(trained["longest_sample"], linestyle="--", color="#b04040", label="longest training sample")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"context length at the draft (tokens; buckets of {MIN_PLOTTED_DRAFTS}+ drafts)")
    ax.set_ylabel("mean acceptance length")
    ax.set_title("Acceptance by context length (parity replay, T = 0)")
    ax.legend(fontsize=7)
    save_figure(fig, out)


def plot_training(metrics: list[dict[str, Any]], out: str) -> None:
    plt = pyplot()
    train = [m for m in metrics if m["split"] == "train"]
    evals = [m for m in metrics if m["split"] == "eval"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.2))
    ax1.plot([m["step"] for m in train], [m["loss"] for m in train], label="train")
    ax1.plot([m["step"] for m in evals], [m["loss"] for m in evals], "o-", label="eval")
    ax1.set_xlabel("step")
    ax1.set_ylabel("loss")
    ax1.legend()
    # EAGLE-3's chain reports full_acc_k (all of the first k+1 right); the other methods each
    # draft position's accuracy (train/methods/base.py, DraftMethod.summarise).
    curves = sorted(key for key in metrics[0] if key.startswith(("full_acc_", "position_acc_")))
    for key in curves:
        ax2.plot([m["step"] for m in evals], [m[key] for m in evals], "o-", label=key)
    ax2.set_xlabel("step")
    ax2.set_ylabel("eval accuracy")
    ax2.set_ylim(0, 1)
    ax2.legend()
    save_figure(fig, out)


def plot_quality(quality: dict[str, Any], out: str) -> None:
    """Samples per defect class; classes that keep a sample out of training stand out."""
    plt = pyplot()
    names = list(quality["counts"]) + ["request_errors"]
    counts = [quality["counts"][n] for n in quality["counts"]] + [quality["request_errors"]]
    colors = ["#b8473b" if n in EXCLUDING or n == "request_errors" else "#3b6ea8" for n in names]
    fig, ax = plt.subplots(figsize=(6, 0.35 * len(names) + 1.2))
    bars = ax.barh(names, counts, color=colors)
    ax.bar_label(bars, labels=[f"{c} ({c / max(1, quality['num_samples']):.1%})" for c in counts], padding=3)
    ax.invert_yaxis()
    ax.set_xlim(0, max(1, max(counts)) * 1.35)
    ax.set_xlabel(f"samples (of {quality['num_samples']}); red: kept out of training")
    ax.set_title("Synthetic data defects")
    save_figure(fig, out)


def plot_vocab_coverage(vocab: dict[str, Any], out: str) -> None:
    """Loss-token coverage against draft vocabulary size, the configured size marked."""
    plt = pyplot()
    curve = vocab["coverage_curve"]
    fig, ax = plt.subplots(figsize=(6, 3.4))
    for split in ("train", "eval"):
        ax.plot([p["size"] for p in curve], [p[split] for p in curve], "o-", markersize=3, label=split)
    ax.axvline(
        vocab["draft_vocab_size"], color="grey", linestyle="--", label=f"draft vocab {vocab['draft_vocab_size']}"
    )
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("draft vocabulary size (most frequent train tokens)")
    ax.set_ylabel("loss tokens covered")
    ax.set_title(f"Vocabulary coverage (eval {vocab['coverage_eval']:.1%} at the configured size)")
    ax.legend(loc="lower right")
    save_figure(fig, out)


def plot_prompts(prompts: dict[str, Any], out: str) -> None:
    """Words per conversation (its user turns) in the training prompts, per source."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.2))
    sources = list(prompts["train"])
    width = 0.8 / max(len(sources), 1)
    for j, source in enumerate(sources):
        hist = prompts["train"][source]["words"]["histogram"]
        edges, counts = hist["edges"], hist["counts"]
        total = sum(counts) or 1
        x = [i + (j - (len(sources) - 1) / 2) * width for i in range(len(counts))]
        ax.bar(x, [c / total for c in counts], width, label=f"{source} ({total})")
    tops = [*edges[1:], 0]
    labels = [bucket_label(edges[i], tops[i], i == len(edges) - 1) for i in range(len(edges))]
    ax.set_xticks(range(len(labels)), labels, rotation=30)
    ax.set_xlabel("words in a conversation's user turns")
    ax.set_ylabel("share of training prompts")
    ax.set_title("Training prompts by source")
    ax.legend()
    save_figure(fig, out)
