"""report: report.md and plots from the benchmark, training metrics, data quality and vocab stats."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from workflow_scripts.common.atomic import atomic_path, read_jsonl, write_text

log = logging.getLogger(__name__)


def plot_acceptance(report: dict[str, Any], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per_pos = report["speculative"]["per_position_acceptance"]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    bars = ax.bar([f"pos {i + 1}" for i in range(len(per_pos))], per_pos, color="#3b6ea8")
    ax.bar_label(bars, fmt="%.2f")
    ax.set_ylim(0, 1)
    ax.set_ylabel("accepted / drafts")
    ax.set_title(f"Per-position acceptance (mean length {report['speculative']['mean_acceptance_length']:.2f})")
    fig.tight_layout()
    with atomic_path(out) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)


def plot_training(metrics: list[dict[str, Any]], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [m for m in metrics if m["split"] == "train"]
    evals = [m for m in metrics if m["split"] == "eval"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.2))
    ax1.plot([m["step"] for m in train], [m["loss"] for m in train], label="train")
    ax1.plot([m["step"] for m in evals], [m["loss"] for m in evals], "o-", label="eval")
    ax1.set_xlabel("step")
    ax1.set_ylabel("loss")
    ax1.legend()
    k = sum(1 for key in metrics[0] if key.startswith("full_acc_"))
    for i in range(k):
        ax2.plot([m["step"] for m in evals], [m[f"full_acc_{i}"] for m in evals], "o-", label=f"full_acc_{i}")
    ax2.set_xlabel("step")
    ax2.set_ylabel("eval accuracy")
    ax2.set_ylim(0, 1)
    ax2.legend()
    fig.tight_layout()
    with atomic_path(out) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)


def render_markdown(report: dict, metrics: list[dict], quality: dict, vocab: dict, plots: dict[str, str]) -> str:
    spec, base = report["speculative"], report["baseline"]
    last_eval = [m for m in metrics if m["split"] == "eval"][-1]
    best_eval = min((m for m in metrics if m["split"] == "eval"), key=lambda m: m["loss"])
    per_pos = " / ".join(f"{x:.3f}" for x in spec["per_position_acceptance"])
    lines = [
        "# eagleflow benchmark report",
        "",
        f"Verifier `{report['verifier']}`, draft `{report['draft']}`, "
        f"{report['prompts']['count']} held-out prompts, temperature 0, "
        f"max {report['sampling']['max_tokens']} tokens, concurrency {report['sampling']['concurrency']}, "
        f"{report['num_speculative_tokens']} speculative tokens. Measured by vLLM's own counters.",
        "",
        "| metric | value |",
        "| --- | --- |",
        f"| mean acceptance length | **{spec['mean_acceptance_length']:.3f}** |",
        f"| acceptance rate (accepted / drafted tokens) | {spec['acceptance_rate']:.3f} |",
        f"| per-position acceptance | {per_pos} |",
        f"| output tokens/s without draft | {base['output_tokens_per_s']:.1f} |",
        f"| output tokens/s with draft | {spec['output_tokens_per_s']:.1f} |",
        f"| speedup | **{report['speedup']:.2f}x** |",
        f"| greedy outputs identical with and without draft | {report['outputs_identical_fraction']:.1%} |",
        "",
        f"![per-position acceptance]({plots['acceptance']})",
        "",
        "## Training",
        "",
        f"Best eval loss {best_eval['loss']:.4f} at step {best_eval['step']} (exported); "
        f"training-time estimate of acceptance length 1 + sum(full_acc_k) = "
        f"{best_eval['estimated_acceptance_length']:.3f} (last eval: {last_eval['estimated_acceptance_length']:.3f}).",
        "",
        f"![training curves]({plots['training']})",
        "",
        "## Data",
        "",
        f"{quality['num_samples']} samples from {quality['num_prompts']} prompts; "
        f"{quality['request_errors']} failed conversations. Defects: "
        + ", ".join(f"{k} {v}" for k, v in quality["counts"].items()) + ".",
        "",
        f"Draft vocabulary {vocab['draft_vocab_size']} of {vocab['verifier_vocab_size']} tokens; "
        f"covers {vocab['coverage_train']:.2%} of loss tokens in train, {vocab['coverage_eval']:.2%} in eval.",
        "",
    ]  # fmt: skip
    return "\n".join(lines)


def run_report(report_json: str, metrics: str, quality: str, vocab_stats: str, md_out: str, acceptance_png: str, training_png: str) -> None:
    report = json.loads(Path(report_json).read_text())
    rows = read_jsonl(metrics)
    plot_acceptance(report, acceptance_png)
    plot_training(rows, training_png)
    md_dir = Path(md_out).parent
    plots = {"acceptance": str(Path(acceptance_png).relative_to(md_dir)), "training": str(Path(training_png).relative_to(md_dir))}
    text = render_markdown(report, rows, json.loads(Path(quality).read_text()), json.loads(Path(vocab_stats).read_text()), plots)
    write_text(md_out, text)
    log.info("wrote %s", md_out)
