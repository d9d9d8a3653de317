"""The comparison report written up: report.md's sections and the HTML table, from the
figures report.compare_analysis computes. Pure: strings in, strings out."""

from __future__ import annotations

import html
from typing import Any

from eagleflow.report.compare_analysis import per_token_cost


def describe_learning_curve(fit: dict[str, Any], largest_n: int) -> str:
    if not fit["fit"]:
        return f"The points do not support a fit: {fit['why']}."
    return (
        f"Fit over {fit['points']} points: L = {fit['a']:.3f} + {fit['b']:.3f}·log2(n). Doubling the training "
        f"conversations ({largest_n} → {2 * largest_n}) is expected to add {fit['b']:+.3f} to the mean acceptance "
        f"length (95% interval {fit['low']:+.3f} to {fit['high']:+.3f}, standard error {fit['se']:.3f})."
    )


def recommend_k(predictions: list[dict[str, float]]) -> str:
    best = max(predictions, key=lambda p: p["speedup"])
    if best["speedup"] <= 1:
        return (
            f"No k is predicted to speed this verifier up on this host (best: k={best['k']}, "
            f"{best['speedup']:.2f}x): drafting costs more than the accepted tokens save."
        )
    length = best["mean_acceptance_length"]
    return f"Recommended: k={best['k']} (predicted {best['speedup']:.2f}x, mean acceptance length {length:.2f})."


TABLE = [
    ("variant", "variant", "{}"),
    ("method", "method", "{}"),
    ("k", "k", "{}"),
    ("mean acceptance length (vLLM)", "mean_acceptance_length", "{:.3f}"),
    ("per position", "per_position_acceptance", None),
    ("training estimate", "training_estimate", "{:.3f}"),
    ("training samples", "train_samples", "{}"),
    ("tokens/s with draft", "tokens_per_s", "{:.1f}"),
    ("speedup", "speedup", "{:.2f}x"),
    ("step time / verifier step", "step_ratio", "{:.2f}x"),
    ("training time", "train_s", "{:.0f} s"),
    ("draft size", "draft_mb", "{:.1f} MB"),
]


def cells(row: dict[str, Any], set_keys: list[str]) -> list[str]:
    out = []
    for _, key, fmt in TABLE:
        value = row[key]
        out.append(" / ".join(f"{x:.3f}" for x in value) if fmt is None else fmt.format(value))
    return out + [f"{row['set_lengths'][k]:.3f}" if k in row["set_lengths"] else "" for k in set_keys]


def set_columns(rows: list[dict[str, Any]]) -> list[str]:
    """The other sets' cells (`mt_bench@T0`, ...) any variant measured, in measurement order. Pure."""
    return list(dict.fromkeys(k for r in rows for k in r["set_lengths"]))


def ranking_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The drafts ranked by what vLLM measured on the held-out prompts (greedy): acceptance
    length, then speedup; each method at its own draft length. With one draft, nothing. Pure."""
    if len(rows) < 2:
        return []

    def ranked(key: str, fmt: str) -> str:
        order = sorted(rows, key=lambda r: -r[key])  # stable: ties keep the variants' order
        return " > ".join(f"`{r['variant']}` ({r['method']}, k={r['k']}) {fmt.format(r[key])}" for r in order)

    return [
        "Ranked by what vLLM measured on the held-out prompts at T = 0 (each draft at its own length; "
        "`results/<run>/best/draft` is the first by the config's `best` rule):",
        "",
        f"- mean acceptance length: {ranked('mean_acceptance_length', '{:.3f}')}",
        f"- speedup: {ranked('speedup', '{:.2f}x')}",
        "",
    ]


def render_comparison(
    rows: list[dict[str, Any]],
    curve: list[dict[str, Any]],
    fit: dict[str, Any],
    source: dict[str, Any],
    predictions: list[dict[str, float]],
    checks: list[tuple[dict[str, Any], dict[str, float]]],
    plots: dict[str, str],
) -> str:
    """report.md of the run. Pure."""
    set_keys = set_columns(rows)
    lines = [
        "# eagleflow run report",
        "",
        "Every draft of the run, measured by vLLM on the same held-out prompts (details in each variant's "
        "`variants/<name>/report/report.md`). Speedups are against the verifier alone: "
        + "; ".join(sorted({f"{r['baseline_measurement']}" for r in rows}))
        + ".",
        "",
        "| " + " | ".join([h for h, _, _ in TABLE] + [f"mean acceptance length, {k}" for k in set_keys]) + " |",
        "|" + " --- |" * (len(TABLE) + len(set_keys)),
        *("| " + " | ".join(cells(r, set_keys)) + " |" for r in rows),
        "",
        f"![per-position acceptance per variant]({plots['acceptance_png']})",
        "",
        *ranking_lines(rows),
        "## Learning curve",
        "",
    ]
    if len(curve) < 2:
        lines.append("No learning curve in this run (`learning_curve.fractions` is empty).")
    else:
        points = ", ".join(f"{r['train_samples']} samples: {r['mean_acceptance_length']:.3f}" for r in curve)
        lines += [
            f"Mean acceptance length by training samples ({points}).",
            "",
            describe_learning_curve(fit, max(r["train_samples"] for r in curve)),
        ]
    lines += [
        "",
        f"![learning curve]({plots['learning_curve_png']})",
        "",
        "## Number of speculative tokens",
        "",
        f"From variant `{source['variant']}` at k={source['k']} (chain drafting: L(k') = 1 + Σ p_i over the "
        "first k' positions; step time T_v + c·k with T_v from the verifier alone and c from the speculative "
        "run):",
        "",
        "| k | predicted mean acceptance length | predicted speedup |",
        "| --- | --- | --- |",
        *(f"| {p['k']} | {p['mean_acceptance_length']:.3f} | {p['speedup']:.2f}x |" for p in predictions),
        "",
        recommend_k(predictions),
        "",
    ]
    if per_token_cost(source["per_position_acceptance"], source["baseline_tokens_per_s"], source["tokens_per_s"]) < 0:
        lines += [
            "Caution: with the draft, a verifier step took less time than without it, which the model "
            "cannot explain: the machine's speed changed between the two measurements. Speedups here are "
            "not reliable; `benchmark.paired_baseline: true` measures both in the same job.",
            "",
        ]
    for run, predicted in checks:
        lines.append(
            f"Check against variant `{run['variant']}` measured at k={run['k']}: mean acceptance length "
            f"{run['mean_acceptance_length']:.3f} measured vs {predicted['mean_acceptance_length']:.3f} predicted; "
            f"speedup {run['speedup']:.2f}x measured vs {predicted['speedup']:.2f}x predicted."
        )
    if not checks:
        lines.append(
            "No run at another k to check the prediction against "
            "(add a variant with `benchmark: {num_speculative_tokens: ...}`)."
        )
    lines += ["", f"![speculative tokens]({plots['k_png']})", ""]
    return "\n".join(lines)


def render_generation(stats: dict[str, Any], plot: str) -> str:
    """The generate stage's section of report.md: what it sent, and its concurrency. Pure."""
    lines = [
        "## Generation",
        "",
        f"{stats['requests']} requests: {stats['sent']} sent to the verifier, {stats['reused']} answered by the "
        f"response store; {stats['failed_conversations']} failed conversations; "
        f"{stats.get('server_restarts', 0)} server restart(s); {stats['wall_s']:.0f} s.",
        "",
    ]
    limit = stats.get("concurrency")
    if not stats["sent"] or not limit:
        lines.append("No request went to the server in the last generate job: no concurrency to show.")
    else:
        mode = (
            f"adaptive, ceiling {limit['ceiling']}: {limit['decreases']} decrease(s), ended at {limit['final']}"
            if limit["adaptive"]
            else f"fixed at {limit['ceiling']}"
        )
        lines.append(f"Concurrency {mode}; the server reported {limit['server_preemptions']} preemption(s).")
    return "\n".join([*lines, "", f"![generate concurrency]({plot})", ""])


def render_loads(loads: dict[str, dict[str, int]]) -> str:
    """The verifier loads section of report.md: starts and restarts per stage. Pure."""
    lines = [
        "## Verifier loads",
        "",
        "Every start of the verifier recorded in this run directory (every invocation, retrains included; "
        "`logs/servers/loads.jsonl`). The hidden-state shard jobs share one server per phase.",
        "",
        "| stage | starts | restarts after a crash |",
        "|---|---|---|",
    ]
    for name, kinds in loads.items():
        lines.append(f"| {name} | {kinds.get('start', 0)} | {kinds.get('restart', 0)} |")
    total = sum(sum(k.values()) for k in loads.values())
    return "\n".join([*lines, f"| total | {total} | |", ""])


def render_html(rows: list[dict[str, Any]]) -> str:
    set_keys = set_columns(rows)
    headers = [h for h, _, _ in TABLE] + [f"mean acceptance length, {k}" for k in set_keys]
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells(r, set_keys)) + "</tr>" for r in rows)
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>eagleflow variants</title>"
        "<style>body{font-family:sans-serif;margin:1em}td,th{padding:.2em .8em;border-bottom:1px solid #ddd}"
        f"</style></head><body><table><tr>{head}</tr>{body}</table></body></html>\n"
    )
