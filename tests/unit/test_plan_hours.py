"""The plan's hours per stage and to a served draft (dag/plan/hours.py): the arithmetic, the
replicas, the rates a finished run measured."""

import json

import pytest

from eagleflow.common.atomic import write_json
from eagleflow.dag.plan.hours import (
    MeasuredRates,
    Rates,
    measured_rates,
    planned_work,
    render_hours,
    scaled,
    stage_hours,
)
from eagleflow.dag.plan.needs import load_merged_config
from eagleflow.dag.variants import merged
from tests.helpers import REPO

CONFIG = load_merged_config([], REPO)
RATES = Rates(
    reply_tokens=None,
    generate_tokens_per_s=100.0,
    extract_tokens_per_s=1000.0,
    train_tokens_per_s=500.0,
    verifier_load_s=60.0,
    replicas=(1, 4),
)


def test_each_stage_is_a_load_and_its_tokens_at_its_rate():
    config = merged(CONFIG, {"prompts": {"written": {"count": 10, "turns": 2, "max_tokens": 50}}})
    work = planned_work(samples=100, tokens=36_000, exact=True, config=config, rates=RATES)
    assert (work.written_tokens, work.reply_tokens) == (1000, 100 * 160)
    one, four = stage_hours(work, RATES, 1, config), stage_hours(work, RATES, 4, config)
    assert one["write_prompts"] == pytest.approx((60 + 1000 / 100) / 3600)
    assert one["generate"] == pytest.approx((60 + 16_000 / 100) / 3600)
    assert four["generate"] == pytest.approx((60 + 16_000 / 400) / 3600)
    # One extraction server per node, whatever the replicas; training is one job.
    assert one["hidden_states"] == four["hidden_states"] == pytest.approx((60 + 36_000 / 1000) / 3600)
    two_nodes = merged(config, {"hidden_states": {"num_parts": 2}})
    assert stage_hours(work, RATES, 1, two_nodes)["hidden_states"] == pytest.approx((60 + 36_000 / 2000) / 3600)
    # A grown run extracts what the store lacks; a run the store answers in full loads nothing.
    grown = planned_work(samples=100, tokens=36_000, exact=True, config=config, rates=RATES, stored_tokens=30_000)
    assert stage_hours(grown, RATES, 1, config)["hidden_states"] == pytest.approx((60 + 6_000 / 1000) / 3600)
    stored = planned_work(samples=100, tokens=36_000, exact=True, config=config, rates=RATES, stored_tokens=36_000)
    assert stage_hours(stored, RATES, 1, config)["hidden_states"] == 0
    assert one["train"] == pytest.approx(36_000 * CONFIG["train"]["epochs"] / 500 / 3600)
    online = merged(config, {"hidden_states": {"mode": "online"}})
    assert stage_hours(work, RATES, 1, online)["hidden_states"] == 0


def test_each_draft_trains_at_its_methods_rate_and_is_benchmarked():
    """Drafts of several methods: each training at its method's measured rate (of its
    epochs and sample fraction), one after another; one benchmark run per draft beside the
    baseline's."""
    epochs = CONFIG["train"]["epochs"]
    drafts = [
        CONFIG["train"],
        {**CONFIG["train"], "method": "dflash"},
        {**CONFIG["train"], "method": "peagle", "epochs": 2 * epochs, "sample_fraction": 0.25},
    ]
    rates = Rates(**{**RATES.__dict__, "train_tokens_per_s": None})
    rates = MeasuredRates(**rates.__dict__, measured_train=(("dflash", 125.0), ("eagle3", 500.0), ("peagle", 400.0)))
    work = planned_work(samples=100, tokens=36_000, exact=True, config=CONFIG, rates=rates, drafts=drafts)
    hours = stage_hours(work, rates, 1, CONFIG)
    passes = 36_000 * epochs
    assert hours["train"] == pytest.approx((passes / 500 + passes / 125 + passes * 0.5 / 400) / 3600)
    one = planned_work(samples=100, tokens=36_000, exact=True, config=CONFIG, rates=rates)
    bench = stage_hours(one, rates, 1, CONFIG)["benchmark"]
    assert hours["benchmark"] == pytest.approx(bench * 4 / 2)
    # A method no run measured and the config does not rate leaves training open, by name.
    unrated = MeasuredRates(**{**rates.__dict__, "measured_train": (("eagle3", 500.0),)})
    assert stage_hours(work, unrated, 1, CONFIG)["train"] is None
    table = render_hours(work, unrated, CONFIG)
    assert "train_tokens_per_s (dflash)" in table and "train_tokens_per_s (peagle)" in table
    assert "(eagle3)" not in table


def test_an_expected_reply_length_lowers_the_upper_bound_and_sizes_scale():
    rates = Rates(**{**RATES.__dict__, "reply_tokens": 60})
    bound = planned_work(samples=100, tokens=100 * (40 + 160), exact=False, config=CONFIG, rates=rates)
    assert (bound.reply_tokens, bound.tokens) == (6000, 100 * (40 + 60))
    exact = planned_work(samples=100, tokens=12_345, exact=True, config=CONFIG, rates=rates)
    assert exact.tokens == 12_345
    big = scaled(bound, 10_000)
    assert (big.samples, big.tokens, big.reply_tokens) == (10_000, 1_000_000, 600_000)
    assert big.benchmark_tokens == bound.benchmark_tokens  # the measured sets do not grow


def test_an_unknown_rate_leaves_its_stage_and_the_total_open():
    rates = Rates(**{**RATES.__dict__, "train_tokens_per_s": None})
    work = planned_work(samples=100, tokens=36_000, exact=True, config=CONFIG, rates=rates)
    table = render_hours(work, rates, CONFIG, samples=[100, 1000])
    rows = [line for line in table.splitlines() if line.startswith("| 1")]
    cells = [[c.strip() for c in row.split("|")[1:-1]] for row in rows]
    assert len(cells) == 4 and all(c[5] == "?" and c[7] == "?" and c[3] != "?" for c in cells)
    assert "Unknown rates" in table and "train_tokens_per_s" in table


def test_a_finished_run_supplies_the_rates_it_measured(tmp_path):
    run = tmp_path / "results/r"
    write_json(run / "generate/stats.json", {"sent_tokens": 3000, "server_s": 20.0})
    # The extracted tokens over the seconds the jobs extracted (not their servers' starts; the
    # stored tokens took none).
    write_json(run / "hidden_states/stats.json", {"tokens": 9000, "extracted_tokens": 5000, "extract_s": 10.0})
    # Each method's rate from its drafts' training rows (a draft's method: its export's config,
    # speculators' or, for EAGLE-3's MLA draft, vLLM's own).
    for draft, method, speeds in (
        ("default", None, (100, 300, 200)),
        ("d-1", "dflash", (50, 40, 60)),
        ("d-2", "dflash", (80, 80, 90)),
        ("d-3", "peagle", None),  # not exported yet: no method, no rate
    ):
        (run / f"drafts/{draft}/train").mkdir(parents=True)
        rows = [{"split": "train", "tokens_per_s": v} for v in speeds or (1,)] + [{"split": "eval"}]
        (run / f"drafts/{draft}/train/metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        if speeds:
            config = (
                {"architectures": ["Eagle3DeepseekV2ForCausalLM"]}
                if method is None
                else {"speculators_model_type": method}
            )
            write_json(run / f"drafts/{draft}/draft/config.json", config)
    unset = Rates(None, None, None, None, 60.0, (1,))
    rates, notes = measured_rates(tmp_path, "r", unset)
    assert (rates.generate_tokens_per_s, rates.extract_tokens_per_s) == (150, 500)
    assert rates.train_rate("eagle3") == 200 and rates.train_rate("dflash") == 65 and rates.train_rate("peagle") is None
    assert len(notes) == 4
    # A rate the config sets wins over the measured one.
    configured = measured_rates(tmp_path, "r", RATES)[0]
    assert Rates(**{f: getattr(configured, f) for f in RATES.__dataclass_fields__}) == RATES
    assert configured.train_rate("dflash") == RATES.train_tokens_per_s


def test_served_training_takes_the_slower_of_training_and_the_epochs_extraction_and_stores_nothing():
    """Served mode: no hidden-state stage; every epoch extracts every token again while the
    draft trains on them (they overlap), after one start of the train job's server."""
    served = merged(CONFIG, {"hidden_states": {"mode": "served"}})
    work = planned_work(samples=100, tokens=36_000, exact=True, config=served, rates=RATES)
    epochs = CONFIG["train"]["epochs"]
    hours = stage_hours(work, RATES, 1, served)
    assert hours["hidden_states"] == 0
    # Training (500 tok/s) is slower than extraction (1000 tok/s): it sets the pace.
    assert hours["train"] == pytest.approx((60 + 36_000 * epochs / 500) / 3600)
    slow_server = Rates(**{**RATES.__dict__, "extract_tokens_per_s": 100.0})
    assert stage_hours(work, slow_server, 1, served)["train"] == pytest.approx((60 + 36_000 * epochs / 100) / 3600)
    two = merged(served, {"hidden_states": {"served": {"endpoints": ["http://a:8000", "http://b:8000"]}}})
    assert stage_hours(work, slow_server, 1, two)["train"] == pytest.approx((60 + 36_000 * epochs / 200) / 3600)
    unknown = Rates(**{**RATES.__dict__, "extract_tokens_per_s": None})
    assert stage_hours(work, unknown, 1, served)["train"] is None
