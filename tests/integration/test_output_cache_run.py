"""The output cache on a real run (a copy of the finished test run): what the user forces is
recomputed, whatever the cache holds; states extracted again with the same bytes (a forced
stage, a refactor of the extraction code) restore the draft instead of training it again; a
grown dataset extracts only what it adds."""

import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq

from devkit.runs import copy_finished_run, planned_jobs
from eagleflow.hidden_states.shard_file import shard_content_digest
from tests.helpers import REPO, SNAKEMAKE

CONFIG = ["--configfile", str(REPO / "tests/config/small.yaml")]


def snakemake(wf, *args) -> str:
    proc = subprocess.run([*SNAKEMAKE, *CONFIG, *args], cwd=wf, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout + proc.stderr


class Logs:
    """What each job's log holds that it did not at the last look: Snakemake removes a job's
    log before it runs the job again, and a job appends to it."""

    def __init__(self, logs_dir):
        self.dir = logs_dir
        self.seen = {}

    def new(self, name: str) -> str:
        text = (self.dir / f"{name}.log").read_text()
        old = self.seen.get(name, "")
        self.seen[name] = text
        return text[len(old) :] if text.startswith(old) else text

    def mark(self, *names: str) -> None:
        for name in names:
            self.new(name)


def stored_states(run) -> dict[str, str]:
    """Each stored sample's file (as the index names it) and the digest of what it holds,
    verified against its tensors."""
    index = json.loads((run / "hidden_states/index.json").read_text())
    return {s["file"]: shard_content_digest(run / "hidden_states" / s["file"], verify=True) for s in index["samples"]}


def test_forced_stages_recompute_and_identical_states_restore_the_draft(finished_run, tmp_path):
    wf = copy_finished_run(finished_run, tmp_path / "wf")
    run = wf / "results/small"
    parts = sorted((run / "hidden_states").glob("part-*.json"))
    assert len(parts) == 1
    draft = run / "drafts/default/draft/model.safetensors"
    # By content: safetensors writes its header's metadata in no fixed order, so the same
    # states come out as other bytes.
    states = stored_states(run)
    digests = sorted(states.values())
    logs = Logs(run / "logs")
    names = [f"hidden_states.{p.stem}" for p in parts]
    logs.mark(*names, "train.default")

    # The dry run says what the cache will do.
    plan = snakemake(wf, "-n", "-R", "hidden_states", "--until", "train")
    assert "Output cache: recomputed: hidden_states 1 (forced" in plan, plan[-3000:]
    assert "restored if their key matches the entry kept: train 1" in plan
    assert "compute only what their store lacks" in snakemake(
        wf, "-n", "-R", "dataset", "--until", "hidden_states_index"
    )

    # -R: every sample extracted again (a new write time, an extraction in the parts' logs)
    # although the store holds it; the states come out byte-identical, so the draft, keyed by
    # their content, is restored with no training step.
    mtimes = {f: (run / "hidden_states" / f).stat().st_mtime_ns for f in states}
    draft_mtime = draft.stat().st_mtime_ns
    snakemake(wf, "--cores", "2", "-R", "hidden_states", "--until", "train")
    for name in names:
        log = logs.new(name)
        assert "forced: every sample again" in log, log[-2000:]
    assert all((run / "hidden_states" / f).stat().st_mtime_ns > m for f, m in mtimes.items())
    assert stored_states(run) == states, "deterministic on one machine"
    train_log = logs.new("train.default")
    assert "0 training steps" in train_log, train_log[-2000:]
    assert draft.stat().st_mtime_ns > draft_mtime  # restored: as new as the job that restored it

    # A refactor of the extraction code that writes the same states: Snakemake reruns the part
    # jobs (their code changed), every sample's key changed with the code so they extract
    # again, and the draft is restored again by content. The old keys' files are then named by
    # no index, and prune removes exactly those.
    extraction = wf / "workflow/eagleflow/hidden_states/hf.py"  # the states' code; not training's
    extraction.write_text(extraction.read_text() + "\n_EAGLEFLOW_REFACTOR = 1\n")
    snakemake(wf, "--cores", "2", "--until", "train")
    for name in names:
        assert "found stored" in logs.new(name)
    refactored = stored_states(run)
    assert set(refactored).isdisjoint(states) and sorted(refactored.values()) == digests
    assert json.loads((run / "hidden_states/stats.json").read_text())["stored_samples"] == 0
    assert "0 training steps" in logs.new("train.default")
    pruned = subprocess.run(
        [sys.executable, "-m", "eagleflow.runtime.output_cache", "prune", "results"],
        cwd=wf,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert f"dropped {len(states)} stored samples no index names" in pruned, pruned
    assert not any((run / "hidden_states" / f).exists() for f in states)
    assert stored_states(run) == refactored

    # Deleted outputs (a manifest and the index: what a failed cluster job leaves) are written
    # again from the store: no sample extracted.
    parts[0].unlink()
    (run / "hidden_states/index.json").unlink()
    snakemake(wf, "--cores", "2", "--until", "hidden_states_index")
    assert "; 0 to extract (0 tokens)" in logs.new(names[0])
    assert planned_jobs(snakemake(wf, "-n", "--until", "hidden_states_index")) == {}


def test_a_grown_dataset_extracts_exactly_its_new_samples(finished_run, tmp_path):
    """N samples added to the finished run's dataset: the part jobs rerun, and the store
    answers every sample but the N (counted by the phase's stats.json)."""
    wf = copy_finished_run(finished_run, tmp_path / "wf")
    run = wf / "results/small"
    before = json.loads((run / "hidden_states/index.json").read_text())
    train = pq.read_table(run / "dataset/train.parquet")
    rows = train.to_pylist()
    # New conversations: the first samples cut short (other tokens, so other states).
    grown = [
        {**r, "id": f"grown{k}#t0", "input_ids": r["input_ids"][:-3], "loss_mask": r["loss_mask"][:-3]}
        for k, r in enumerate(rows[:5])
    ]
    for r in grown:
        r["length"] = len(r["input_ids"])
    pq.write_table(pa.Table.from_pylist(rows + grown, schema=train.schema), run / "dataset/train.parquet")
    # The plan counts what the grown dataset adds, not the whole dataset again.
    from eagleflow.dag.plan.needs import load_merged_config, make_plan

    plan = make_plan(load_merged_config([str(REPO / "tests/config/small.yaml")], wf), wf)
    assert (plan.tokens.new_samples, plan.tokens.stored_samples) == (len(grown), before["num_samples"])
    assert plan.tokens.new_tokens == sum(len(r["input_ids"]) for r in grown)
    snakemake(wf, "--cores", "2", "--until", "hidden_states_index")
    stats = json.loads((run / "hidden_states/stats.json").read_text())
    assert stats["extracted_samples"] == len(grown) and stats["stored_samples"] == before["num_samples"]
    assert stats["extracted_tokens"] == sum(len(r["input_ids"]) for r in grown)
    after = json.loads((run / "hidden_states/index.json").read_text())
    old = {s["id"]: s["digest"] for s in before["samples"]}
    assert {s["id"]: s["digest"] for s in after["samples"] if s["id"] in old} == old
