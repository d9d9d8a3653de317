"""The run's comparison report: every variant's draft side by side, the learning curve, and
the number of speculative tokens to serve with. This module is the stage's shell: it reads
each variant's report, metrics, train benchmark and draft, and writes report.md, report.html
and the plots; the numbers are report.compare_analysis's (its docstring states the two
models), the text report.compare_render's, the plots report.compare_plots'.
"""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path
from typing import Any

from eagleflow.common.atomic import read_jsonl, write_text
from eagleflow.report.compare_analysis import fit_learning_curve, predict_k, variant_row
from eagleflow.report.compare_plots import plot_acceptance_by_variant, plot_concurrency, plot_k, plot_learning_curve
from eagleflow.report.compare_render import recommend_k, render_comparison, render_generation, render_html, render_loads
from eagleflow.runtime.ledger import count_loads, read_loads
from eagleflow.runtime.shared_server import stop_idle_shared_servers
from eagleflow.runtime.smk import stage

log = logging.getLogger(__name__)


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
