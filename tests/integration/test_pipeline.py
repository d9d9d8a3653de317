"""The whole DAG on a small config, with a real vLLM, checked against the data contracts."""

import json
import shutil
import subprocess
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from devkit.configs import merged
from devkit.runs import copy_finished_run, planned_jobs
from eagleflow.common.atomic import read_jsonl
from eagleflow.runtime.ledger import count_loads, read_loads
from tests.helpers import REPO, SNAKEMAKE, vllm_available, vllm_processes

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]


def written_entries(wf: Path) -> int:
    """The store entries write_prompts made before generate ran (its completions: one per
    written one-turn conversation), which no request of generate uses."""
    return json.loads((wf / "results/small/prompts/written_stats.json").read_text())["sent"]


def test_a_hard_kill_mid_generate_leaves_no_vllm_and_the_rerun_sends_each_request_once(finished_run):
    killed = json.loads((finished_run / "hard_kill.json").read_text())
    assert killed["leases"] == 1, "the killed generate job had one server"
    assert killed["vllm_processes_left"] == [], "vLLM processes outlived kill -9 of Snakemake's process group"
    stats = json.loads((finished_run / "results/small/generate/stats.json").read_text())
    written = written_entries(finished_run)
    assert stats["reused"] == killed["stored_at_kill"] - written
    assert stats["sent"] + stats["reused"] == stats["requests"] == stats["store_entries"] - written
    assert stats["store_entries_unused"] == written


def test_a_vllm_killed_mid_generate_is_restarted_and_every_sample_is_generated_once(finished_run):
    killed = json.loads((finished_run / "server_kill.json").read_text())
    assert killed["killed"], f"generate finished before its server could be killed: {killed}"
    stats = json.loads((finished_run / "results/small/generate/stats.json").read_text())
    assert stats["server_restarts"] == 1 and stats["failed_conversations"] == 0
    # Every request answered and stored once: the in-flight ones were sent again, nothing twice.
    written = written_entries(finished_run)
    assert stats["sent"] + stats["reused"] == stats["requests"] == stats["store_entries"] - written
    assert stats["reused"] == killed["stored_before_rerun"] - written
    log = (finished_run / "results/small/logs/generate.0-of-1.log").read_text()
    assert "died while serving (killed by SIGKILL)" in log and "Restart 1 of 3" in log, log[-3000:]


def results(run: Path) -> Path:
    return run / "results/small"


def responses_of(r: Path) -> list[dict]:
    return pq.read_table(r / "synth/responses.parquet").to_pylist()


def split_rows(r: Path, split: str) -> list[dict]:
    return pq.read_table(r / f"dataset/{split}.parquet").to_pylist()


def train_metrics(r: Path) -> list[dict]:
    return [json.loads(line) for line in (r / "drafts/default/train/metrics.jsonl").read_text().splitlines()]


# The data contracts (docs/data-contracts.md), one test a stage: a failure names the stage.


def test_generate_and_synth_outputs_meet_their_contract(finished_run):
    r = results(finished_run)
    responses = responses_of(r)
    assert len(responses) >= 24  # every train prompt, plus extra turns of multi-turn prompts
    generated = json.loads((r / "generate/stats.json").read_text())
    assert generated["requests"] == generated["sent"] + generated["reused"] == len(responses)
    for s in responses:
        assert s["prompt_token_ids"] and s["completion_token_ids"]
        assert len(s["completion_token_ids"]) == s["completion_tokens"]
        assert s["finish_reason"] in ("stop", "length")
    assert len({s["id"] for s in responses}) == len(responses)
    quality = json.loads((r / "synth/quality.json").read_text())
    assert quality["num_samples"] == len(responses) and quality["request_errors"] == 0


def test_dataset_output_meets_its_contract(finished_run):
    r = results(finished_run)
    train, evals = split_rows(r, "train"), split_rows(r, "eval")
    assert train and evals
    by_id = {s["id"]: s for s in responses_of(r)}
    for row in train + evals:
        s = by_id[row["id"]]
        assert row["input_ids"] == s["prompt_token_ids"] + s["completion_token_ids"]
        assert row["loss_mask"] == [0] * len(s["prompt_token_ids"]) + [1] * len(s["completion_token_ids"])


def test_vocab_output_meets_its_contract(finished_run):
    r = results(finished_run)
    vocab = load_file(r / "vocab/default/vocab_map.safetensors")
    assert vocab["d2t"].shape == (1024,) and vocab["d2t"].dtype == torch.int64
    assert vocab["t2d"].shape == (49152,) and vocab["t2d"].dtype == torch.bool and vocab["t2d"].sum() == 1024
    chosen = torch.arange(1024) + vocab["d2t"]
    assert torch.equal(torch.nonzero(vocab["t2d"]).flatten(), chosen)
    stats = json.loads((r / "vocab/default/stats.json").read_text())
    assert stats["coverage_train"] > 0.9
    curve = stats["coverage_curve"]
    assert curve[-1]["train"] == pytest.approx(1.0) and any(p["size"] == 1024 for p in curve)


def test_hidden_states_output_meets_its_contract(finished_run):
    r = results(finished_run)
    train, evals = split_rows(r, "train"), split_rows(r, "eval")
    index = json.loads((r / "hidden_states/index.json").read_text())
    assert index["aux_layer_ids"] == [2, 15, 27] and len(list((r / "hidden_states").glob("part-*.json"))) == 1
    assert index["num_tokens"] == sum(len(x["input_ids"]) for x in train + evals)
    assert sorted(s["id"] for s in index["samples"]) == sorted(x["id"] for x in train + evals)
    # One file per sample in the store (none shared: no two samples have the same tokens here).
    assert len({s["file"] for s in index["samples"]}) == index["num_samples"]
    stats = json.loads((r / "hidden_states/stats.json").read_text())
    assert stats["samples"] == index["num_samples"] and stats["tokens"] == index["num_tokens"]
    with safe_open(str(r / "hidden_states" / index["samples"][0]["file"]), framework="pt") as f:
        assert f.get_slice("hidden_states").get_shape()[1] == 3 * 576


def test_train_output_meets_its_contract(finished_run):
    r = results(finished_run)
    metrics = train_metrics(r)
    assert any(m["split"] == "train" for m in metrics) and any(m["split"] == "eval" for m in metrics)
    assert {"step", "loss", "lr", "tokens_per_s", "full_acc_0", "full_acc_2"} <= set(metrics[0])
    draft_config = json.loads((r / "drafts/default/draft/config.json").read_text())
    assert draft_config["speculators_model_type"] == "eagle3"
    assert draft_config["draft_vocab_size"] == 1024
    assert draft_config["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    assert (r / "drafts/default/draft/model.safetensors").is_file()


def test_benchmark_output_meets_its_contract(finished_run):
    r = results(finished_run)
    report = json.loads((r / "variants/default/benchmark/report.json").read_text())
    for key in ("output_tokens_per_s",):
        assert report["baseline"][key] > 0 and report["speculative"][key] > 0
    spec = report["speculative"]
    assert spec["num_drafts"] > 0
    # The draft learned: its eval loss fell from its first evaluation (an untrained draft's stays),
    # and vLLM accepts its drafts on the held-out prompts. An untrained draft is accepted nowhere
    # (1.000 over the same 109 drafts: the test config's 4 steps at 1024 tokens); its 20 steps at
    # 256 measured 1.138, so 1.03 (4 accepted tokens) leaves room for another machine's kernels.
    evals = [m["loss"] for m in train_metrics(r) if m["split"] == "eval"]
    assert len(evals) >= 2 and evals[-1] < 0.97 * evals[0], evals
    assert spec["mean_acceptance_length"] >= 1.03, spec
    assert len(spec["per_position_acceptance"]) == report["num_speculative_tokens"] == 3
    # The figures from vLLM's counters: the accepted tokens, each position's, the drafted ones.
    accepted = spec["num_accepted_tokens"]
    assert spec["mean_acceptance_length"] == pytest.approx(1.0 + accepted / spec["num_drafts"])
    assert accepted == pytest.approx(sum(spec["per_position_acceptance"]) * spec["num_drafts"])
    assert spec["acceptance_rate"] == pytest.approx(accepted / spec["num_draft_tokens"])
    assert report["speedup"] == pytest.approx(spec["output_tokens_per_s"] / report["baseline"]["output_tokens_per_s"])
    # Every set at 0 and the set with temperatures of its own at 0.7 too (tests/config/small.yaml:
    # an MT-Bench question of 2 turns, a HumanEval stub, a long prompt), the eval split at 0 the
    # headline; later turns carry the baseline's replies, which the baseline job kept.
    cells = report["cells"]
    names = ("eval", "mt_bench", "humaneval", "long_context")
    assert list(cells) == [f"{s}@T0" for s in names] + ["mt_bench@T0.7"]
    assert cells["eval@T0"]["speculative"] == spec and cells["eval@T0"]["speedup"] == report["speedup"]
    assert [cells[f"{s}@T0"]["requests"] for s in names] == [4, 2, 1, 1]
    assert cells["mt_bench@T0.7"]["seed"] == 0 and cells["mt_bench@T0"]["seed"] is None
    assert cells["mt_bench@T0.7"]["outputs_identical_fraction"] is None
    assert all(c["speculative"]["num_drafts"] > 0 for c in cells.values())
    baseline = json.loads((r / "baseline/report.json").read_text())
    assert [len(replies) for replies in baseline["cells"]["mt_bench@T0"]["replies"].values()] == [2]
    # Greedy outputs with the draft (the streams kept for parity) against the baseline's, turn by
    # turn: the fraction each cell at 0 reports.
    served: dict[str, dict[str, list]] = {}
    for stream in read_jsonl(r / "variants/default/benchmark/streams.jsonl"):
        served.setdefault(stream["set"], {}).setdefault(stream["id"].split("#")[0], []).append(stream["token_ids"])
    for name in names:
        outputs = baseline["cells"][f"{name}@T0"]["outputs"]
        pairs = [(a, b) for pid, turns in outputs.items() for a, b in zip(turns, served[name][pid], strict=True)]
        assert cells[f"{name}@T0"]["outputs_identical_fraction"] == sum(a == b for a, b in pairs) / len(pairs), name
    assert report["outputs_identical_fraction"] == cells["eval@T0"]["outputs_identical_fraction"]
    sets = {s["name"]: s for s in json.loads((r / "benchmark_sets.json").read_text())["sets"]}
    assert [p["id"] for p in sets["mt_bench"]["prompts"]] == ["mt_bench-81"]


def test_parity_output_meets_its_contract(finished_run):
    r = results(finished_run)
    # Parity replays every set's greedy streams; by context length, they sum to each set's replay.
    parity = json.loads((r / "variants/default/parity/report.json").read_text())
    streams = [json.loads(line) for line in (r / "variants/default/benchmark/streams.jsonl").read_text().splitlines()]
    assert [s["set"] for s in streams] == ["eval"] * 4 + ["mt_bench"] * 2 + ["humaneval", "long_context"]
    long_prompt = len(streams[-1]["prompt_token_ids"])
    assert 0.25 * 2048 < long_prompt <= 0.5 * 2048 - 32  # within fill less the reply, by whole problems
    context = parity["context"]
    for name, rows in context["sets"].items():
        assert sum(row["num_drafts"] for row in rows) > 0, name
        assert sum(row["accepted_per_pos"][0] for row in rows) > 0 or parity["sets"][name]["replay"] == 1.0, name
    eval_rows = context["sets"]["eval"]
    assert sum(row["num_drafts"] for row in eval_rows) == parity["replay"]["num_drafts"]
    assert [sum(row["accepted_per_pos"][i] for row in eval_rows) for i in range(3)] == [
        round(a * parity["replay"]["num_drafts"]) for a in parity["replay"]["per_position_acceptance"]
    ]
    assert any(row["num_drafts"] for row in context["sets"]["long_context"] if row["context_from"] >= 512)
    assert context["trained"]["longest_sample"] == max(len(x["input_ids"]) for x in split_rows(r, "train"))


def test_report_output_meets_its_contract(finished_run):
    r = results(finished_run)
    generated = json.loads((r / "generate/stats.json").read_text())
    md = (r / "variants/default/report/report.md").read_text()
    assert "## Benchmark sets" in md and "### mt_bench" in md and "| 0.7 (seed 0) |" in md
    assert "mean acceptance length" in md and "speedup" in md
    assert f"{generated['sent']} sent / {generated['reused']} reused from the store" in md
    assert "## Acceptance by context length" in md
    for plot in (
        "acceptance_per_position",
        "acceptance_by_context",
        "training_curves",
        "data_quality",
        "vocab_coverage",
    ):
        assert (r / f"variants/default/report/{plot}.png").read_bytes()[:4] == b"\x89PNG", plot
        assert f"({plot}.png)" in md
    assert "mean acceptance length" in (r / "variants/default/report/summary.html").read_text()


def test_the_verifier_writes_prompts_that_reach_training_and_the_report(finished_run):
    r = finished_run / "results/small"
    written = json.loads((r / "prompts/written_stats.json").read_text())
    assert written["conversations"] == 24 and written["sent"] == 24 and written["failed"] == 0
    assert written["end_of_turn_token"] == "<|im_end|>" and written["ended"] >= 12
    rows = read_jsonl(r / "prompts/written.jsonl")
    assert all(len(row["keys"]) == 1 and row["turns"][0] == row["turns"][0].strip() for row in rows)
    stats = json.loads((r / "prompts/stats.json").read_text())
    assert stats["filters"]["removed"]["not_ended"]["count"] == 24 - written["ended"]
    train = read_jsonl(r / "prompts/train.jsonl")
    used = stats["sources"]["written"]["train"]
    assert 1 <= used == sum(p["source"] == "written" for p in train) < len(train)
    responses = {s["id"].split("#")[0] for s in pq.read_table(r / "synth/responses.parquet").to_pylist()}
    assert {p["id"] for p in train if p["source"] == "written"} <= responses
    report = (r / "variants/default/report/report.md").read_text()
    assert "## Prompts" in report and "| written | 24 |" in report
    assert (r / "variants/default/report/training_prompts.png").stat().st_size > 10_000


def test_a_rerun_of_write_prompts_and_a_filter_change_send_no_request(finished_run, tmp_path):
    """The store answers every written request: a server that cannot answer (a dead endpoint)
    is never asked; a filter change does not rerun write_prompts at all."""
    from eagleflow.common.config import typed
    from eagleflow.prompts.config import WrittenConfig
    from eagleflow.prompts.written import run_write_prompts
    from eagleflow.runtime.answers import Client
    from eagleflow.runtime.spec import ServerConfig
    from tests.slurm_cluster import load_small

    r = finished_run / "results/small"
    config = load_small()
    store = tmp_path / "store.sqlite"
    shutil.copy(r / "generate/store.sqlite", store)
    out = tmp_path / "written.jsonl"
    run_write_prompts(
        str(finished_run / "resources/verifier/smollm2-135m-instruct"),
        str(store),
        str(out),
        str(tmp_path / "stats.json"),
        cfg=typed(WrittenConfig, config["prompts"]["written"], "prompts.written"),
        model="verifier",
        replies=None,
        chat_template_kwargs={},
        trust_remote_code=False,
        client=Client(4, False, 5.0, 1, None, "auto"),
        server=ServerConfig.from_section({**config["server"], "endpoint": "http://127.0.0.1:9"}),
        server_log=str(tmp_path / "vllm.log"),
    )
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert (stats["sent"], stats["reused"], stats["server_started"]) == (0, 24, False)
    assert out.read_text() == (r / "prompts/written.jsonl").read_text()


def test_snakemake_report_embeds_every_plot(finished_run, tmp_path):
    html = tmp_path / "report.html"
    cmd = SNAKEMAKE + ["--report", str(html), "--configfile", str(REPO / "tests/config/small.yaml")]
    proc = subprocess.run(cmd, cwd=finished_run, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = html.read_text()
    for name in (
        "summary.html",
        "acceptance_per_position.png",
        "acceptance_by_context.png",
        "training_curves.png",
        "data_quality.png",
        "vocab_coverage.png",
    ):
        assert name in text, f"{name} missing from the Snakemake report"
    assert "Per-position acceptance" in text  # a caption, rendered
    assert text.count("data:image/png;base64") >= 5 or text.count("iVBORw0KGgo") >= 5  # the PNGs themselves


def test_no_vllm_process_outlives_the_run(finished_run):
    assert vllm_processes(str(finished_run)) == []
    # The killed generate's lease was cleared by the rerun's; the others by their own jobs.
    assert list((finished_run / "results/small/logs/servers").glob("*.json")) == []


def test_the_hidden_state_phase_loads_the_verifier_once_and_the_report_counts_every_load(finished_run):
    run = finished_run / "results/small"
    records = read_loads(run / "logs/servers")
    loads = count_loads(records)
    assert len(sorted((run / "logs").glob("hidden_states.part-*.log"))) == 1
    # One job on this machine, with its own server: one load, shared with no other job.
    assert loads["hidden_states"] == {"start": 1}, loads
    assert [r["shared"] for r in records if r["stage"] == "hidden_states"] == [False]
    # generate: the hard-killed run's start, the rerun's, and the restart after its SIGKILL.
    assert loads["generate"] == {"start": 2, "restart": 1} and loads["baseline"] == loads["benchmark"] == {"start": 1}
    assert loads["write_prompts"] == {"start": 1}  # before the hard kill; the rerun found its outputs
    report = (run / "report.md").read_text()
    assert "## Verifier loads" in report and "| hidden_states | 1 | 0 |" in report and "| total | 8 | |" in report
    assert loads["parity"] == {"start": 1}, loads


def test_dry_run_after_a_full_run_has_nothing_to_do(finished_run):
    cmd = SNAKEMAKE + ["-n", "--configfile", str(REPO / "tests/config/small.yaml")]
    out = subprocess.run(cmd, cwd=finished_run, capture_output=True, text=True, check=True)
    assert "Nothing to be done" in out.stdout + out.stderr


def stale_rules(wf: Path, config: Path = REPO / "tests/config/small.yaml") -> set[str]:
    """The rules `snakemake -n` would run (their `reason:` lines say why)."""
    out = subprocess.run(
        SNAKEMAKE + ["-n", "--configfile", str(config)], cwd=wf, capture_output=True, text=True, check=True
    ).stdout
    return set(planned_jobs(out)) - {"all"}


DOWNSTREAM_OF_SYNTH = {
    "synth",
    "dataset",
    "vocab",
    "hidden_states",
    "hidden_states_index",
    "train",
    "benchmark",
    "parity",
    "report",
    "compare",
    "best_draft",
}
# best_draft reads every variant's benchmark report and draft: it follows both.
PER_DRAFT = {"train", "benchmark", "parity", "report", "compare", "best_draft"}
GENERATE = {"generate", "generate_join"}  # the shard jobs and their join
BENCHMARKS = {"baseline", "benchmark", "parity", "report", "compare", "best_draft"}


# One module per stage boundary, through Snakemake itself; every module's row of the table in
# docs/invalidation.md is checked against the fingerprints in test_invalidation_table.py, and
# test_comments_and_docs_restale_nothing checks that a restored tree plans nothing.
@pytest.mark.parametrize(
    "module, expected",
    [
        ("generate/run.py", DOWNSTREAM_OF_SYNTH | GENERATE),
        ("synth/assemble.py", DOWNSTREAM_OF_SYNTH),
        ("dataset.py", DOWNSTREAM_OF_SYNTH - {"synth"}),
        ("vocab.py", PER_DRAFT | {"vocab"}),
        ("hidden_states/hf.py", PER_DRAFT | {"hidden_states", "hidden_states_index"}),
        ("train/loop.py", PER_DRAFT),
        ("benchmark/baseline.py", BENCHMARKS),
        # The drafts' benchmark only: the verifier alone runs no draft code.
        ("benchmark/run.py", BENCHMARKS - {"baseline"}),
        ("benchmark/parity.py", {"parity", "report", "compare"}),
        ("report/compare.py", {"compare"}),
    ],
)
def test_editing_a_stage_module_restales_exactly_it_and_downstream(finished_run, module, expected):
    path = finished_run / "workflow/eagleflow" / module
    original = path.read_text()
    try:
        path.write_text(original + "\n_EAGLEFLOW_TEST_EDIT = 1\n")
        assert stale_rules(finished_run) == expected
    finally:
        path.write_text(original)


def test_comments_and_docs_restale_nothing(finished_run):
    path = finished_run / "workflow/eagleflow/generate/run.py"
    original = path.read_text()
    try:
        path.write_text(
            "# a comment about the generator\n"
            + original.replace('"""The generate stage', '"""The generate (reworded) stage', 1)
        )
        (finished_run / "README.md").write_text("edited\n")
        assert stale_rules(finished_run) == set()
    finally:
        path.write_text(original)


def test_a_copy_elsewhere_plans_nothing_and_a_fix_that_changes_no_byte_costs_no_load(finished_run, tmp_path):
    """On a copy of the finished run in another directory (no param holds an absolute path):
    `snakemake -n` plans nothing, and the draft still names a verifier vLLM loads. Then early
    cut-off: an edit of generate's code that changes no request reruns every rule downstream,
    and each finds its key unchanged: no verifier start, no request, no shard extracted, no
    training step; dataset, shards and draft byte-identical."""
    moved = tmp_path / "moved"
    copy_finished_run(finished_run, moved)  # mtimes kept
    assert stale_rules(moved) == set()
    run = moved / "results/small"
    draft = json.loads((run / "drafts/default/draft/config.json").read_text())
    assert Path(draft["speculators_config"]["verifier"]["name_or_path"]).is_dir()

    kept = ["dataset/train.parquet", "dataset/eval.parquet", "hidden_states/index.json"]
    kept += [str(p.relative_to(run)) for p in sorted((run / "drafts/default/draft").iterdir())]
    before = {name: (run / name).read_bytes() for name in kept}
    loads_before = len(read_loads(run / "logs/servers"))
    generate = moved / "workflow/eagleflow/generate/run.py"
    generate.write_text(generate.read_text() + "\n_EAGLEFLOW_TEST_EDIT = 1\n")
    # The draft's key holds the verifier path as configured (here the prepared directory,
    # relative to the workdir), not where the run sits: the copy restores the original's draft,
    # which names the verifier the original prepared.
    configs = [str(REPO / "tests/config/small.yaml")]
    stale = set(
        planned_jobs(
            subprocess.run(
                [*SNAKEMAKE, "-n", "--configfile", *configs], cwd=moved, capture_output=True, text=True, check=True
            ).stdout
        )
    )
    assert {"generate", "synth", "dataset", "hidden_states", "train", "benchmark", "parity"} <= stale
    started = time.monotonic()
    proc = subprocess.run(
        [*SNAKEMAKE, "--cores", "2", "--configfile", *configs], cwd=moved, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (tmp_path / "early_cutoff_wall_s.txt").write_text(f"{time.monotonic() - started:.1f}\n")
    assert len(read_loads(run / "logs/servers")) == loads_before, "a verifier was started"
    stats = json.loads((run / "generate/stats.json").read_text())
    assert stats["sent"] == 0 and stats["reused"] == stats["requests"]
    logs = run / "logs"
    # Each message is written only by a job that links its outputs back.
    # The part jobs found every sample stored: none reached the verifier.
    assert "; 0 to extract (0 tokens)" in (logs / "hidden_states.part-00000.log").read_text()
    assert json.loads((run / "hidden_states/stats.json").read_text())["extracted_samples"] == 0
    assert "0 training steps" in (logs / "train.default.log").read_text()
    # The baseline reads only the verifier and the eval prompts: not downstream of generate.
    assert "baseline" not in stale
    for rule in ("benchmark.default", "parity.default"):
        assert "outputs linked back" in (logs / f"{rule}.log").read_text(), rule
    assert {name: (run / name).read_bytes() for name in kept} == before
    again = subprocess.run([*SNAKEMAKE, "-n", "--configfile", *configs], cwd=moved, capture_output=True, text=True)
    assert "Nothing to be done" in again.stdout + again.stderr


def test_editing_run_only_code_restales_nothing(finished_run):
    """A statement appended to every module of workflow/eagleflow/runtime (server launch,
    supervision, leases, recovery, client, concurrency, logging, GPU locks, the ledger, the
    Snakemake adapter): the finished run plans no job. All at once in one dry run: a fingerprint
    is per module, so any one edit that restaled a rule would restale it here too."""
    paths = sorted((finished_run / "workflow/eagleflow/runtime").glob("*.py"))
    assert len(paths) >= 15
    originals = {path: path.read_text() for path in paths}
    try:
        for path, text in originals.items():
            path.write_text(text + "\n_EAGLEFLOW_TEST_EDIT = 1\n")
        assert stale_rules(finished_run) == set()
    finally:
        for path, text in originals.items():
            path.write_text(text)


def another_value(prop: dict, value):
    """A valid value of a config key other than `value`, from its schema property."""
    if "enum" in prop:
        return next(v for v in prop["enum"] if v != value)
    for option in prop.get("oneOf", []):
        kinds = option.get("type", [])
        if isinstance(value, int) and not isinstance(value, bool) and "integer" in kinds:
            return another_value(option, value)
    kinds = prop.get("type")
    kinds = set(kinds) if isinstance(kinds, list) else {kinds}
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value + 1 if value + 1 <= prop.get("maximum", value + 1) else value - 1
    if isinstance(value, list):
        return value[:1] if len(value) > 1 else [*value, *value] or [1]
    if value is None:
        if "integer" in kinds:
            return max(1, prop.get("minimum", 1))
        if "number" in kinds:
            return 1.5
        if "array" in kinds:
            return [another_value(prop.get("items", {}), None)]
        # A string the schema constrains by a pattern: its example.
        return prop.get("examples", ["EAGLEFLOW_TEST_VALUE"])[0]
    return value + "-changed"


def test_every_key_that_changes_no_result_changed_at_once_plans_no_job(finished_run, tmp_path):
    """The keys config/README.md says change no result and rerun no rule (the schema's
    `x-changes-results: false`, outside every section a rule takes whole), each set to another
    valid value in one config: `snakemake -n` on the finished run plans nothing."""
    import yaml

    from devkit import config_reference as ref
    from eagleflow.common.config import validate_config

    _, schema, defaults = ref.load()
    keys = ref.run_only_keys(schema, ref.whole_section_rules())
    assert {"server.max_restarts", "generate.concurrency", "throughput.replicas"} <= set(keys)
    cfg = yaml.safe_load((REPO / "tests/config/small.yaml").read_text())
    props = ref.documented_keys(schema)
    for key in keys:
        section, *path, name = key.split(".")
        value = ref.default_of(merged(defaults, cfg), key)
        target = cfg.setdefault(section, {})
        for part in path:
            target = target.setdefault(part, {})
        target[name] = another_value(ref.resolved(props[key], schema["$defs"]), value)
    validate_config(merged(defaults, cfg))
    changed = tmp_path / "run-only.yaml"
    changed.write_text(yaml.safe_dump(cfg))
    assert stale_rules(finished_run, changed) == set()


@pytest.mark.parametrize(
    "override, expected",
    [
        ({"train": {"lr": 0.0005}}, PER_DRAFT),
        ({"vocab": {"draft_vocab_size": 512}}, PER_DRAFT | {"vocab"}),
        ({"synth": {"expect_reasoning": True}}, DOWNSTREAM_OF_SYNTH),
        ({"generate": {"concurrency": 3, "max_attempts": 2, "store_locking": "exclusive"}}, set()),
        ({"generate": {"max_tokens": 40}}, DOWNSTREAM_OF_SYNTH | GENERATE),
        # New shard jobs (which the store answers) and their join; what follows links back.
        ({"generate": {"shards": 2}}, DOWNSTREAM_OF_SYNTH | GENERATE),
        ({"hidden_states": {"dtype": "float8_e4m3fn"}}, PER_DRAFT | {"hidden_states", "hidden_states_index"}),
        ({"hidden_states": {"mode": "online"}}, PER_DRAFT),
        ({"benchmark": {"sets": [{"name": "mt_bench", "size": 3}]}}, BENCHMARKS | {"benchmark_sets"}),
        # A filter decides which written prompts are used, never what is asked: no write_prompts.
        (
            {"prompts": {"filters": {"near_duplicate": 0.8}}},
            DOWNSTREAM_OF_SYNTH | GENERATE | {"prompts", "benchmark_sets", "baseline"},
        ),
    ],
    ids=[
        "train.lr",
        "vocab.draft_vocab_size",
        "synth.expect_reasoning",
        "generate.concurrency",
        "generate.max_tokens",
        "generate.shards",
        "hidden_states.dtype",
        "hidden_states.mode",
        "benchmark.sets",
        "prompts.filters",
    ],
)
def test_a_parameter_change_restales_exactly_its_stage_and_downstream(finished_run, tmp_path, override, expected):
    import yaml

    cfg = yaml.safe_load((REPO / "tests/config/small.yaml").read_text())
    for section, values in override.items():
        cfg[section] = merged(cfg.get(section) or {}, values)
    changed = tmp_path / "changed.yaml"
    changed.write_text(yaml.safe_dump(cfg))
    assert stale_rules(finished_run, changed) == expected


def planned(wf: Path, config: Path) -> set[tuple[str, str]]:
    """(rule, variant or "") of every job `snakemake -n` plans."""
    out = subprocess.run(
        SNAKEMAKE + ["-n", "--configfile", str(config)], cwd=wf, capture_output=True, text=True, check=True
    ).stdout
    jobs, rule, variant = set(), None, ""
    for line in [*out.splitlines(), "rule end:"]:
        if line.startswith(("rule ", "localrule ")):
            if rule:
                jobs.add((rule, variant))
            rule, variant = line.split()[-1].rstrip(":"), ""
        elif "wildcards:" in line and "variant=" in line:
            variant = line.split("variant=")[1].split(",")[0].strip()
    return jobs - {("all", ""), ("end", "")}


@pytest.mark.parametrize(
    "variants, expected",
    [
        (
            {"lr-low": {"train": {"lr": 0.0003}}},
            {
                ("train", ""),
                ("benchmark", "lr-low"),
                ("parity", "lr-low"),
                ("report", "lr-low"),
                ("compare", ""),
                ("best_draft", ""),
            },
        ),
        (
            {"vocab-512": {"vocab": {"draft_vocab_size": 512}}},
            {
                ("vocab", ""),
                ("train", ""),
                ("benchmark", "vocab-512"),
                ("parity", "vocab-512"),
                ("report", "vocab-512"),
                ("compare", ""),
                ("best_draft", ""),
            },
        ),
        (
            {"k1": {"benchmark": {"num_speculative_tokens": 1}}},
            {("benchmark", "k1"), ("parity", "k1"), ("report", "k1"), ("compare", ""), ("best_draft", "")},
        ),
    ],
    ids=["train", "vocab", "k"],
)
def test_adding_a_variant_plans_only_its_own_jobs(finished_run, tmp_path, variants, expected):
    """Never the baseline, the default draft or anything upstream of the vocabulary; a
    vocabulary only when the variant's vocab section differs."""
    import yaml

    cfg = yaml.safe_load((REPO / "tests/config/small.yaml").read_text())
    cfg["variants"] = variants
    changed = tmp_path / "variants.yaml"
    changed.write_text(yaml.safe_dump(cfg))
    assert planned(finished_run, changed) == expected


def test_the_run_report_has_the_comparison_of_its_one_variant(finished_run):
    r = finished_run / "results/small"
    md = (r / "report.md").read_text()
    assert "| default | eagle3 | 3 |" in md and "No learning curve in this run" in md
    assert "No run at another k to check the prediction against" in md
    assert "| mean acceptance length, mt_bench@T0 |" in md and "| mean acceptance length, mt_bench@T0.7 |" in md
    baseline = json.loads((r / "baseline/report.json").read_text())
    report = json.loads((r / "variants/default/benchmark/report.json").read_text())
    assert report["baseline"]["output_tokens_per_s"] == baseline["output_tokens_per_s"]


def test_the_plan_counts_the_bytes_the_stored_states_take(finished_run):
    from eagleflow.dag.plan.needs import load_merged_config, make_plan
    from eagleflow.hidden_states.storage import shard_bytes

    config = load_merged_config([str(REPO / "tests/config/small.yaml")], finished_run)
    plan = make_plan(config, finished_run)
    t = plan.tokens
    assert t.source.startswith("exact")
    # Every sample is stored: the phase would write nothing more.
    assert (t.stored_samples, t.stored_tokens, plan.disk[0]["bytes"]) == (t.samples, t.tokens, 0)
    written = sum(
        p.stat().st_size for p in (finished_run / "results/small/hidden_states/samples").rglob("*.safetensors")
    )
    # What a run that stores them all writes, as the plan counts it (3 aux states and the final, 576 wide).
    assert shard_bytes(t.tokens, t.samples, 4, 576, "bfloat16") == pytest.approx(written, rel=0.05)


def test_online_mode_trains_without_shards(finished_run, tmp_path):
    """The same run switched to online mode: no hidden-state job, and a train job that loads
    the verifier itself (counted). The draft it exports is the offline draft's format, which
    the shared run benchmarks in vLLM (and BENCHMARKS.md measures online: 1.657 on the demo)."""
    import yaml

    wf = tmp_path / "wf"
    copy_finished_run(finished_run, wf)
    shutil.rmtree(wf / "results/small/hidden_states")  # online needs none of it
    serve_path = str((finished_run / "resources/verifier/smollm2-135m-instruct").resolve())
    (wf / "online.yaml").write_text(
        yaml.safe_dump({"hidden_states": {"mode": "online"}, "verifier": {"serve_path": serve_path}})
    )
    cmd = SNAKEMAKE + ["--cores", "2", "--configfile", str(REPO / "tests/config/small.yaml"), "online.yaml"]
    dry = subprocess.run([*cmd, "-n"], cwd=wf, capture_output=True, text=True, check=True)
    assert set(planned_jobs(dry.stdout)) - {"all"} == PER_DRAFT
    assert "Verifier loads this run takes: 3 (train 1, benchmark 1, parity 1 (shared by 1 parity jobs))" in dry.stderr
    loads_before = len(read_loads(wf / "results/small/logs/servers"))
    # Targets before --configfile, which takes every word after it.
    train = [*SNAKEMAKE, "results/small/drafts/default/draft", *cmd[len(SNAKEMAKE) :]]
    done = subprocess.run(train, cwd=wf, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-4000:]
    assert not (wf / "results/small/hidden_states").exists()
    new = read_loads(wf / "results/small/logs/servers")[loads_before:]
    assert [r["stage"] for r in new] == ["train"]
    config = json.loads((wf / "results/small/drafts/default/draft/config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    rows = [
        json.loads(line) for line in (wf / "results/small/drafts/default/train/metrics.jsonl").read_text().splitlines()
    ]
    assert rows[-1]["split"] == "eval" and rows[-1]["target_agreement"] > 0.9
