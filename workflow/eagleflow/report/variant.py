"""report: report.md, an HTML summary and plots from the benchmark, training metrics, data
quality and vocab stats. The plots and the summary are also what `snakemake --report` shows."""

from __future__ import annotations

import html
import json
import logging
from pathlib import Path
from typing import Any

from eagleflow.common.atomic import read_jsonl, write_text
from eagleflow.common.exported_eval import exported_eval
from eagleflow.report.variant_plots import (
    bucket_label,
    plot_acceptance,
    plot_context,
    plot_prompts,
    plot_quality,
    plot_training,
    plot_vocab_coverage,
)
from eagleflow.runtime.smk import stage

log = logging.getLogger(__name__)


def prompt_section(prompts: dict[str, Any] | None, plot: str | None) -> list[str]:
    """The prompt set: its sources, what each filter removed (with examples), its lengths and
    variety."""
    if prompts is None:
        return []
    lines = [
        "## Prompts",
        "",
        "| source | loaded | kept | weight | train | eval | words (mean, max) | distinct 1-/2-grams |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, src in prompts["sources"].items():
        d = prompts["train"].get(name) or {}
        w = d.get("words") or {}
        lines.append(
            f"| {name} | {src['loaded']} | {src['kept']} | {src['weight']:g} | {src['train']} | {src['eval']} | "
            f"{w.get('mean')}, {w.get('max')} | {d.get('distinct_1')} / {d.get('distinct_2')} |"
        )
    removed = prompts["filters"]["removed"]
    lines += ["", "| filter | removed | by source | example |", "| --- | --- | --- | --- |"]
    for reason, r in removed.items():
        example = r["examples"][0] if r["examples"] else None
        shown = f"{_cell(example['text'][:80])} ({_cell(example['detail'])})" if example else ""
        by_source = ", ".join(f"{k} {v}" for k, v in r["by_source"].items())
        lines.append(f"| {reason} | {r['count']} | {by_source} | {shown} |")
    lines.append("")
    if plot:
        lines += [f"![training prompts by source]({plot})", ""]
    for name, d in prompts["train"].items():
        lines += [f"Examples ({name}):", "", *(f"- {_cell(e[:160])}" for e in d["examples"]), ""]
    return lines


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def describe_requests(generate: dict) -> str:
    """What the data cost in inference: requests sent to the verifier vs answered by the store."""
    total = max(generate["requests"], 1)
    share = generate["reused"] / total
    return f"{generate['sent']} sent / {generate['reused']} reused from the store ({share:.0%} reused)"


def parity_rows(parity: dict | None) -> list[tuple[str, str]]:
    """The parity job's figures (none without one). Pure."""
    if parity is None:
        return []
    verdict = "pass" if parity["verdict"] == "pass" else "GAP: " + ", ".join(f["check"] for f in parity["findings"])
    if parity.get("replay") is None:
        return [("replay of the served streams (parity)", f"not available: {parity['replay_unavailable']}: {verdict}")]
    return [
        (
            "replay of the served streams (parity)",
            f"{parity['replay']['mean_acceptance_length']:.3f} (vLLM - replay {parity['gap']:+.3f}): {verdict}",
        ),
        (
            "replay over every anchor (the training estimate's measure)",
            f"{parity['replay_every_anchor']['mean_acceptance_length']:.3f}",
        ),
    ]


def summary_rows(
    report: dict, metrics: list[dict], quality: dict, vocab: dict, generate: dict, parity: dict | None = None
) -> list[tuple[str, str]]:
    """The headline numbers, shared by report.md and the HTML summary. Pure."""
    spec, base = report["speculative"], report["baseline"]
    best_eval = exported_eval(metrics)
    return [
        ("mean acceptance length", f"{spec['mean_acceptance_length']:.3f}"),
        ("acceptance rate (accepted / drafted tokens)", f"{spec['acceptance_rate']:.3f}"),
        ("per-position acceptance", " / ".join(f"{x:.3f}" for x in spec["per_position_acceptance"])),
        ("output tokens/s without draft", f"{base['output_tokens_per_s']:.1f}"),
        ("output tokens/s with draft", f"{spec['output_tokens_per_s']:.1f}"),
        ("speedup", f"{report['speedup']:.2f}x"),
        ("greedy outputs identical with and without draft", f"{report['outputs_identical_fraction']:.1%}"),
        ("training estimate of acceptance length (best eval)", f"{best_eval['estimated_acceptance_length']:.3f}"),
        *(
            [
                (
                    "training estimate as vLLM counts (anchors it visits, eval split)",
                    f"{best_eval['walk_acceptance_length']:.3f}",
                )
            ]
            if best_eval.get("walk_acceptance_length") is not None
            else []
        ),
        *parity_rows(parity),
        ("best eval loss (exported draft)", f"{best_eval['loss']:.4f} at step {best_eval['step']}"),
        ("samples / failed conversations", f"{quality['num_samples']} / {quality['request_errors']}"),
        ("verifier requests of the last generate", describe_requests(generate)),
        ("draft vocabulary coverage (train / eval)", f"{vocab['coverage_train']:.2%} / {vocab['coverage_eval']:.2%}"),
    ]


def describe_measurement(report: dict) -> str:
    return (
        f"Verifier `{report['verifier']}`, draft `{report['draft']}`, "
        f"{report['prompts']['count']} held-out prompts (first turns), temperature 0, "
        f"max {report['sampling']['max_tokens']} tokens, concurrency {report['sampling']['concurrency']}, "
        f"a {report['method']} draft of {report['num_speculative_tokens']} speculative tokens. "
        "Measured by vLLM's own counters; "
        f"the verifier alone: {report['baseline_measurement']}."
    )


def set_tables(report: dict) -> list[str]:
    """A table per benchmark set (the eval split first): each temperature's mean acceptance
    length, per-position acceptance and speedup, as markdown lines. Pure."""
    lines = [
        "## Benchmark sets",
        "",
        "Each set measured with the same server flags, at each temperature (above 0 sampled with the "
        "seed shown); parity replays every set at temperature 0 (its checks on the eval split).",
        "",
    ]
    by_set: dict[str, list[dict]] = {}
    for cell in report["cells"].values():
        by_set.setdefault(cell["set"], []).append(cell)
    for name, cells in by_set.items():
        source = report["set_sources"][name]
        skipped = source["skipped_too_long"]
        lines += [
            f"### {name}",
            "",
            f"{source['source']}; {cells[0]['requests']} requests per temperature"
            + (f"; {len(skipped)} conversations skipped: too long for server.max_model_len" if skipped else "")
            + ".",
            "",
            "| temperature (seed) | mean acceptance length | per-position acceptance | speedup | identical outputs |",
            "| --- | --- | --- | --- | --- |",
        ]
        for c in sorted(cells, key=lambda c: c["temperature"]):
            spec = c["speculative"]
            seed = "" if c["seed"] is None else f" (seed {c['seed']})"
            same = "" if c["outputs_identical_fraction"] is None else f"{c['outputs_identical_fraction']:.0%}"
            lines.append(
                f"| {c['temperature']:g}{seed} | {spec['mean_acceptance_length']:.3f} | "
                + " / ".join(f"{x:.3f}" for x in spec["per_position_acceptance"])
                + f" | {c['speedup']:.2f}x | {same} |"
            )
        lines.append("")
    return lines


def context_table(parity: dict | None, plot: str) -> list[str]:
    """Acceptance by context length (parity's replay of every set's greedy streams): mean
    acceptance length and drafts per bucket, over all sets and per set, the longest context
    the draft was trained on beside it, and each set's replay next to vLLM's, as markdown
    lines. Pure."""
    if not parity or "context" not in parity:
        return []
    context, names = parity["context"], list(parity["context"]["sets"])
    trained = context["trained"]
    lines = [
        "## Acceptance by context length",
        "",
        "Where each draft was proposed: the tokens the verifier had seen (prompt and output), from "
        "parity's replay of every set's greedy streams (the anchors vLLM visits). The draft was "
        f"trained on samples of up to {trained['longest_sample']} tokens (dataset.max_seq_len "
        f"{trained['max_seq_len']}).",
        "",
        "| context (tokens) | drafts | all sets | " + " | ".join(names) + " |",
        "| --- | --- | --- | " + " | ".join("---" for _ in names) + " |",
    ]
    edges = context["edges"]

    def al(row: dict) -> str:
        return "" if row["mean_acceptance_length"] is None else f"{row['mean_acceptance_length']:.3f}"

    for i, row in enumerate(context["all"]):
        label = bucket_label(edges[i], edges[i + 1], i == len(context["all"]) - 1)
        per_set = " | ".join(al(context["sets"][n][i]) for n in names)
        lines.append(f"| {label} | {row['num_drafts']} | {al(row)} | {per_set} |")
    lines += ["", f"![acceptance by context length]({plot})", ""]
    lines += [
        "Each set's replay next to vLLM's acceptance at T = 0: "
        + "; ".join(
            f"{name} {r['replay']:.3f} / vLLM {r['vllm']:.3f} ({r['streams']} streams)"
            for name, r in parity["sets"].items()
        )
        + ".",
        "",
    ]
    return lines


def parity_findings(parity: dict | None) -> list[str]:
    """The parity checks that failed, with what to check, as markdown lines. Pure."""
    if not parity or not parity["findings"]:
        return []
    lines = ["## Parity findings", ""]
    lines += [f"- **{f['check']}**: {f['detail']}. Check: {f['what_to_check']}." for f in parity["findings"]]
    return [*lines, ""]


def render_markdown(
    report: dict,
    metrics: list[dict],
    quality: dict,
    vocab: dict,
    generate: dict,
    plots: dict[str, str],
    parity: dict | None = None,
    prompts: dict | None = None,
    *,
    estimate: str,
) -> str:
    """The report in Markdown. `estimate`: how training estimates the acceptance length (the
    method's, rule_params.acceptance_estimate)."""
    last_eval = [m for m in metrics if m["split"] == "eval"][-1]
    best_eval = exported_eval(metrics)
    headline = {"mean acceptance length", "speedup"}
    table = [
        f"| {name} | **{value}** |" if name in headline else f"| {name} | {value} |"
        for name, value in summary_rows(report, metrics, quality, vocab, generate, parity)
    ]
    lines = [
        "# eagleflow benchmark report",
        "",
        describe_measurement(report),
        "",
        "| metric | value |",
        "| --- | --- |",
        *table,
        "",
        f"![per-position acceptance]({plots['acceptance']})",
        "",
        *set_tables(report),
        *context_table(parity, plots["context"]),
        *parity_findings(parity),
        "## Training",
        "",
        f"Best eval loss {best_eval['loss']:.4f} at step {best_eval['step']} (exported); "
        f"training-time estimate of acceptance length ({estimate}) = "
        f"{best_eval['estimated_acceptance_length']:.3f} (last eval: {last_eval['estimated_acceptance_length']:.3f}).",
        "",
        f"![training curves]({plots['training']})",
        "",
        "## Data",
        "",
        f"{quality['num_samples']} samples from {quality['num_prompts']} prompts; "
        f"{quality['request_errors']} failed conversations. Defects: "
        + ", ".join(f"{k} {v}" for k, v in quality["counts"].items())
        + ".",
        "",
        f"Verifier requests of the last generate job: {describe_requests(generate)}"
        + ("; no server was started." if not generate["sent"] else "."),
        "",
        f"![data quality]({plots['quality']})",
        "",
        f"Draft vocabulary {vocab['draft_vocab_size']} of {vocab['verifier_vocab_size']} tokens; "
        f"covers {vocab['coverage_train']:.2%} of loss tokens in train, {vocab['coverage_eval']:.2%} in eval.",
        "",
        f"![vocabulary coverage]({plots['vocab']})",
        "",
        *prompt_section(prompts, plots.get("prompts")),
    ]
    return "\n".join(lines)


def render_html(
    report: dict, metrics: list[dict], quality: dict, vocab: dict, generate: dict, parity: dict | None = None
) -> str:
    """A self-contained summary table (what `snakemake --report` shows next to the plots)."""
    rows = "\n".join(
        f"<tr><td>{html.escape(n)}</td><td>{html.escape(v)}</td></tr>"
        for n, v in summary_rows(report, metrics, quality, vocab, generate, parity)
    )
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>eagleflow benchmark</title>"
        "<style>body{font-family:sans-serif;margin:1em}td{padding:.2em "
        ".8em;border-bottom:1px solid #ddd}</style></head><body>"
        f"<p>{html.escape(describe_measurement(report))}</p><table>{rows}</table></body></html>\n"
    )


REPORT_OUTPUTS = (
    "md",
    "html",
    "acceptance_png",
    "context_png",
    "training_png",
    "quality_png",
    "vocab_png",
    "prompts_png",
)


def main(smk) -> None:
    """The report rule's job (workflow/rules/report.smk)."""
    with stage(smk):
        i = smk.input
        outputs = {name: smk.output[name] for name in REPORT_OUTPUTS}
        parity = i.get("parity") or None
        run_report(
            i.report,
            i.metrics,
            i.quality,
            i.vocab_stats,
            i.generate,
            outputs,
            parity,
            i.prompts,
            estimate=smk.params.estimate,
        )


def run_report(
    report_json: str,
    metrics: str,
    quality: str,
    vocab_stats: str,
    generate_stats: str,
    out: dict[str, str],
    parity_json: str | None = None,
    prompts_json: str | None = None,
    *,
    estimate: str,
) -> None:
    """Write out['md'], out['html'] and the plots out['acceptance_png'], ['context_png'],
    ['training_png'], ['quality_png'], ['vocab_png']; with `parity_json`, the replay next to
    vLLM's figures and acceptance by context length; with `prompts_json` (prompts/stats.json),
    the prompt set and out['prompts_png']. `estimate`: as render_markdown's."""
    report = json.loads(Path(report_json).read_text())
    parity = json.loads(Path(parity_json).read_text()) if parity_json else None
    rows = read_jsonl(metrics)
    quality_report = json.loads(Path(quality).read_text())
    vocab = json.loads(Path(vocab_stats).read_text())
    generate = json.loads(Path(generate_stats).read_text())
    plot_acceptance(report, out["acceptance_png"], parity)
    plot_context(parity, out["context_png"])
    plot_training(rows, out["training_png"])
    plot_quality(quality_report, out["quality_png"])
    plot_vocab_coverage(vocab, out["vocab_png"])
    prompts = json.loads(Path(prompts_json).read_text()) if prompts_json else None
    if prompts is not None:
        plot_prompts(prompts, out["prompts_png"])
    md_dir = Path(out["md"]).parent
    plots = {
        k: str(Path(out[f"{k}_png"]).relative_to(md_dir))
        for k in ("acceptance", "context", "training", "quality", "vocab", "prompts")
        if k != "prompts" or prompts is not None
    }
    write_text(
        out["md"],
        render_markdown(report, rows, quality_report, vocab, generate, plots, parity, prompts, estimate=estimate),
    )
    write_text(out["html"], render_html(report, rows, quality_report, vocab, generate, parity))
    log.info("wrote %s and %s", out["md"], out["html"])
