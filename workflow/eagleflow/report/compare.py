"""The run's comparison report: every variant's draft side by side, the learning curve, and
the number of speculative tokens to serve with.

Two models are stated in the report, and both are pure functions here:
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

import csv
import html
import json
import logging
import math
from pathlib import Path
from typing import Any

from eagleflow.benchmark.cells import HEADLINE
from eagleflow.common.atomic import read_jsonl, write_text
from eagleflow.common.exported_eval import exported_eval
from eagleflow.report.compare_plots import plot_acceptance_by_variant, plot_concurrency, plot_k, plot_learning_curve
from eagleflow.runtime.ledger import count_loads, read_loads
from eagleflow.runtime.shared_server import stop_idle_shared_servers
from eagleflow.runtime.smk import stage

log = logging.getLogger(__name__)

# Two-sided 95% quantiles of Student's t for 1..10 degrees of freedom; 1.96 beyond.
T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228]


def main(smk) -> None:
    """The compare rule's job (workflow/rules/report.smk)."""
    with stage(smk):
        variants = list(smk.params.variants)
        rows = [
            variant_row(
                name,
                json.loads(Path(report).read_text()),
                read_jsonl(metrics),
                train_seconds(tsv),
                draft_bytes(draft),
            )
            for name, report, metrics, tsv, draft in zip(
                variants,
                smk.input.reports,
                smk.input.metrics,
                smk.input.train_benchmarks,
                smk.input.drafts,
                strict=True,
            )
        ]
        generate = json.loads(Path(smk.input.generate).read_text())
        servers = Path(smk.log[0]).parent / "servers"
        # The parity jobs' extraction server has served its last job (every report is written).
        stop_idle_shared_servers(servers, "parity")
        loads = count_loads(read_loads(servers))
        run_compare(rows, list(smk.params.learning_curve), smk.params.k_variants, dict(smk.output), generate, loads)


# --- rows ------------------------------------------------------------------------------------


def train_seconds(benchmark_tsv: str) -> float:
    """Wall seconds of the train job, from its Snakemake benchmark file."""
    with open(benchmark_tsv) as fh:
        return float(next(csv.DictReader(fh, delimiter="\t"))["s"])


def draft_bytes(draft_dir: str) -> int:
    return sum(p.stat().st_size for p in Path(draft_dir).glob("*.safetensors"))


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


def describe_learning_curve(fit: dict[str, Any], largest_n: int) -> str:
    if not fit["fit"]:
        return f"The points do not support a fit: {fit['why']}."
    return (
        f"Fit over {fit['points']} points: L = {fit['a']:.3f} + {fit['b']:.3f}·log2(n). Doubling the training "
        f"conversations ({largest_n} → {2 * largest_n}) is expected to add {fit['b']:+.3f} to the mean acceptance "
        f"length (95% interval {fit['low']:+.3f} to {fit['high']:+.3f}, standard error {fit['se']:.3f})."
    )


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


def recommend_k(predictions: list[dict[str, float]]) -> str:
    best = max(predictions, key=lambda p: p["speedup"])
    if best["speedup"] <= 1:
        return (
            f"No k is predicted to speed this verifier up on this host (best: k={best['k']}, "
            f"{best['speedup']:.2f}x): drafting costs more than the accepted tokens save."
        )
    length = best["mean_acceptance_length"]
    return f"Recommended: k={best['k']} (predicted {best['speedup']:.2f}x, mean acceptance length {length:.2f})."


# --- the report ------------------------------------------------------------------------------


def run_compare(
    rows: list[dict[str, Any]],
    learning_curve: list[str],
    k_variants: list[str],
    out: dict[str, str],
    generate: dict[str, Any],
    loads: dict[str, dict[str, int]],
) -> None:
    """Write out['md'], out['html'] and the plots out['acceptance_png'], ['learning_curve_png'],
    ['k_png'] and ['concurrency_png'] (from generate's stats.json: `generate`); `loads` are
    the verifier loads recorded so far (loads.count_loads)."""
    by_name = {r["variant"]: r for r in rows}
    curve = [by_name[v] for v in ["default", *learning_curve] if v in by_name]
    fit = fit_learning_curve([(r["train_samples"], r["mean_acceptance_length"]) for r in curve])
    k_runs = [by_name[v] for v in ["default", *k_variants] if v in by_name]
    source = max(k_runs, key=lambda r: r["k"])
    predictions = predict_k(source["per_position_acceptance"], source["baseline_tokens_per_s"], source["tokens_per_s"])
    checks = [(r, predictions[r["k"] - 1]) for r in k_runs if r is not source and r["k"] <= len(predictions)]
    plot_acceptance_by_variant(rows, out["acceptance_png"])
    plot_learning_curve(curve, fit, out["learning_curve_png"])
    plot_k(predictions, source, checks, out["k_png"])
    plot_concurrency(generate.get("concurrency"), out["concurrency_png"])
    md_dir = Path(out["md"]).parent
    plots = {
        k: str(Path(out[k]).relative_to(md_dir))
        for k in ("acceptance_png", "learning_curve_png", "k_png", "concurrency_png")
    }
    md = render_comparison(rows, curve, fit, source, predictions, checks, plots)
    write_text(
        out["md"], md + "\n" + render_generation(generate, plots["concurrency_png"]) + "\n" + render_loads(loads)
    )
    write_text(out["html"], render_html(rows))
    log.info("compared %d variant(s); %s", len(rows), recommend_k(predictions))


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
