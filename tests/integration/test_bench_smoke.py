"""The bench scripts behind BENCHMARKS.md's figures that read a finished run, each called for
real on a copy of the shared test run at a tiny size, so that a change to the code they drive
cannot leave them broken until the next measurement. bench/README.md says what each measures;
what they print is checked where it is exact (rules, counts, files), never how fast.
(tests/unit/test_bench_smoke.py: the scripts that need no run and no server; vllm_start.py,
which needs no run, is here for its vLLM; test_gpu_check.py: gpu_check.)"""

import csv
import json
import os
from pathlib import Path

import pytest

from devkit.runs import copy_finished_run
from tests.helpers import REPO, run_bench, vllm_available

SMALL = str(REPO / "tests/config/small.yaml")


@pytest.fixture(scope="module")
def run_copy(finished_run, module_tmp):
    """One copy of the finished run for the module: the scripts read it and write nothing into
    it but parser_fix_cost.py's rebuild of dataset/ (last in the module)."""
    return copy_finished_run(finished_run, module_tmp / "wf")


def test_stage_times_lists_every_jobs_benchmark_file(run_copy):
    results = run_copy / "results/small"
    out = run_bench("stage_times.py", results, cwd=run_copy)
    files = list((results / "benchmarks").glob("*.tsv"))
    rules = [line.split("|")[1].strip() for line in out.splitlines()[2:] if line.startswith("| ")]
    assert sorted(rules) == sorted(p.stem for p in files) and "train.default" in rules, out
    walls = [float(list(csv.DictReader(p.read_text().splitlines(), delimiter="\t"))[-1]["s"]) for p in files]
    assert f"sum of job wall times: {sum(walls):.0f} s" in out, out


def test_train_schedule_trains_a_draft_on_the_runs_shards(run_copy, tmp_path):
    # The test config's train section for one epoch: a few steps of the run's own states.
    schedule = {"epochs": 1, "batch_tokens": 256, "lr": 0.003, "log_every": 2, "warmup_steps": 2}
    env = os.environ | {"TMPDIR": str(tmp_path)}  # the script leaves its drafts under the temporary folder
    out = run_bench("train_schedule.py", "results/small", json.dumps(schedule), cwd=run_copy, env=env)
    (row,) = [line for line in out.splitlines() if line.startswith('| {"epochs"')]
    cells = [c.strip() for c in row.strip("|").split("|")]
    steps, draft = int(cells[1]), Path(cells[-1])
    metrics = [json.loads(line) for line in (draft.parent / "metrics.jsonl").read_text().splitlines()]
    assert steps == max(m["step"] for m in metrics) > 0
    best = min((m for m in metrics if m["split"] == "eval"), key=lambda m: m["loss"])
    assert cells[3:6] == [f"{best[k]:.3f}" for k in ("loss", "estimated_acceptance_length", "walk_acceptance_length")]
    assert json.loads((draft / "config.json").read_text())["speculators_model_type"] == "eagle3"


@pytest.mark.vllm
@pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")
def test_standard_sets_measures_the_runs_draft_against_the_verifier_alone(run_copy, tmp_path):
    keep = tmp_path / "keep"
    args = ["--workdir", run_copy, "--configfile", SMALL, "--sets", "mt_bench:1", "--temperatures", 0, "--out", keep]
    out = run_bench("standard_sets.py", *args)
    report = json.loads((keep / "default.json").read_text())
    assert list(report["cells"]) == ["eval@T0", "mt_bench@T0"]
    for key, cell in report["cells"].items():
        spec = cell["speculative"]
        assert spec["num_drafts"] > 0, key
        assert spec["mean_acceptance_length"] == pytest.approx(1.0 + spec["num_accepted_tokens"] / spec["num_drafts"])
        assert f"| default | {cell['set']} | 0 | {cell['requests']} | {spec['mean_acceptance_length']:.3f} |" in out
    # Kept: a second call measures nothing again (no server starts: it returns at once).
    assert run_bench("standard_sets.py", *args) == out


def test_peer_draft_trains_speculators_own_draft_on_the_runs_data(run_copy, tmp_path):
    peer = tmp_path / "peer"
    args = ["--workdir", run_copy, "--configfile", SMALL, "--epochs", 1, "--total-seq-len", 512]
    run_bench("peer_draft.py", *args, "--checkpoint", "last", "--out", peer)
    summary = json.loads((peer / "peer.json").read_text())
    assert summary["method"] == "eagle3" and summary["epochs"] == 1 and summary["exported_epoch"] == 0
    config = json.loads((peer / "draft/config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["draft_vocab_size"] == 1024


def test_parser_fix_cost_rebuilds_the_dataset_without_a_request(run_copy):
    out = run_bench("parser_fix_cost.py", "--run", "small", "--configfile", SMALL, cwd=run_copy)
    cost = json.loads(out)
    assert "generate" not in cost["planned"] and {"synth", "dataset"} <= set(cost["planned"]), cost
    assert cost["requests_sent"] == 0
    quality = json.loads((run_copy / "results/small/synth/quality.json").read_text())
    assert cost["samples"] == quality["num_samples"] > 0
    assert "_PARSER_FIX_BENCHMARK" not in (run_copy / "workflow/eagleflow/synth/assemble.py").read_text()


@pytest.mark.vllm
@pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")
def test_served_states_trains_a_draft_from_the_servers_states_and_stores_none(run_copy, tmp_path):
    # One epoch on the run's data, the states through hs-connectors' file transfer.
    (tmp_path / "one-epoch.yaml").write_text("train: {epochs: 1}\n")
    keep = tmp_path / "keep"
    args = ["--workdir", run_copy, "--configfile", SMALL, tmp_path / "one-epoch.yaml", "--order", "served"]
    run_bench("served_states.py", *args, "--transfer", "file", "--out", keep, timeout=900)
    (result,) = json.loads((keep / "served_states.json").read_text())
    assert result["mode"] == "served" and result["steps"] > 0 and set(result["rule_s"]) == {"train"}
    served = result["served"]
    # Every sample of the one epoch arrived exactly once.
    assert served["transfer"] == "file" and list(served["samples_received_times"]) == ["1"], served
    assert json.loads((Path(result["draft"]) / "config.json").read_text())["speculators_model_type"] == "eagle3"


@pytest.mark.vllm
@pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")
def test_vllm_start_times_a_forked_lean_server_to_healthy_and_reads_its_completion():
    out = run_bench("vllm_start.py", "--trials", 1, "--layouts", "lean-forked")
    (row,) = [line for line in out.splitlines() if line.startswith("| lean-forked |")]
    median, runs = (c.strip() for c in row.strip("|").split("|")[1:3])
    assert 0 < float(median) == float(runs), out
    assert "completions agree across layouts: True" in out
