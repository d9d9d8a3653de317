"""The report says what the data cost in inference: requests sent vs reused from the store."""

from workflow_scripts.report import describe_requests, render_markdown

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
}
METRICS = [{"split": "eval", "step": 10, "loss": 1.0, "estimated_acceptance_length": 1.7}]
QUALITY = {"num_samples": 30, "num_prompts": 28, "request_errors": 0, "counts": {"truncated": 3}}
VOCAB = {"draft_vocab_size": 1024, "verifier_vocab_size": 49152, "coverage_train": 1.0, "coverage_eval": 0.95}
PLOTS = {k: f"{k}.png" for k in ("acceptance", "training", "quality", "vocab")}


def test_requests_sent_and_reused_are_in_the_report():
    rerun = {"requests": 30, "sent": 0, "reused": 30}
    md = render_markdown(REPORT, METRICS, QUALITY, VOCAB, rerun, PLOTS)
    assert "| verifier requests of the last generate | 0 sent / 30 reused from the store (100% reused) |" in md
    assert "no server was started" in md
    first = render_markdown(REPORT, METRICS, QUALITY, VOCAB, {"requests": 30, "sent": 24, "reused": 6}, PLOTS)
    assert "24 sent / 6 reused from the store (20% reused)" in first and "no server was started" not in first


def test_no_requests_is_not_a_division_by_zero():
    assert describe_requests({"requests": 0, "sent": 0, "reused": 0}) == "0 sent / 0 reused from the store (0% reused)"
