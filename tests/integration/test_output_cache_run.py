"""The output cache on a real run (a copy of the finished test run): what the user forces is
recomputed, whatever the cache holds; shards extracted again with the same bytes (a forced
stage, a refactor of the extraction code) restore the draft instead of training it again."""

import subprocess

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


def test_forced_stages_recompute_and_identical_shards_restore_the_draft(finished_run, tmp_path):
    wf = copy_finished_run(finished_run, tmp_path / "wf")
    run = wf / "results/small"
    shards = sorted((run / "hidden_states").glob("shard-*.safetensors"))
    assert len(shards) == 2
    draft = run / "drafts/default/draft/model.safetensors"
    # By content: safetensors writes its header's metadata in no fixed order, so the same
    # states come out as other bytes.
    states = {s.name: shard_content_digest(s, verify=True) for s in shards}
    logs = Logs(run / "logs")
    names = [f"hidden_states.{s.stem}" for s in shards]
    logs.mark(*names, "train.default")

    # The dry run says what the cache will do.
    plan = snakemake(wf, "-n", "-R", "hidden_states", "--until", "train")
    assert "Output cache: recomputed: hidden_states 2 (forced" in plan, plan[-3000:]
    assert "restored if their key matches the entry kept: train 1" in plan

    # -R: both shards extracted again (a new write time, an extraction in their logs) although
    # the cache holds them under the same key; they come out byte-identical, so the draft,
    # keyed by the shards' content, is restored with no training step.
    mtimes = {s.name: s.stat().st_mtime_ns for s in shards}
    draft_mtime = draft.stat().st_mtime_ns
    snakemake(wf, "--cores", "2", "-R", "hidden_states", "--until", "train")
    for shard, name in zip(shards, names, strict=True):
        log = logs.new(name)
        assert "recomputing, not restoring: forced" in log and "samples," in log, log[-2000:]
        assert shard.stat().st_mtime_ns > mtimes[shard.name]
        assert shard_content_digest(shard, verify=True) == states[shard.name], "deterministic on one machine"
    train_log = logs.new("train.default")
    assert "0 training steps" in train_log, train_log[-2000:]
    assert draft.stat().st_mtime_ns > draft_mtime  # restored: as new as the job that restored it

    # A refactor of the extraction code that writes the same states: Snakemake reruns the shard
    # jobs (their code changed), the shard key changed with the code so they extract again, and
    # the draft is restored again by content.
    extraction = wf / "workflow/eagleflow/hidden_states/hf.py"  # the shards' code; not training's
    extraction.write_text(extraction.read_text() + "\n_EAGLEFLOW_REFACTOR = 1\n")
    snakemake(wf, "--cores", "2", "--until", "train")
    for shard, name in zip(shards, names, strict=True):
        log = logs.new(name)
        assert "samples," in log and "linked from" not in log, log[-2000:]
        assert shard_content_digest(shard, verify=True) == states[shard.name]
    assert "0 training steps" in logs.new("train.default")

    # --forceall: every job up to the target recomputes, the shard among them.
    mtime = shards[0].stat().st_mtime_ns
    snakemake(wf, "--cores", "2", "--forceall", str(shards[0].relative_to(wf)))
    log = logs.new(names[0])
    assert "recomputing, not restoring: forced" in log and "samples," in log, log[-2000:]
    assert shards[0].stat().st_mtime_ns > mtime

    # A deleted output is recomputed too, not linked back.
    shards[1].unlink()
    snakemake(wf, "--cores", "2", "--until", "hidden_states_index")
    log = logs.new(names[1])
    assert "recomputing, not restoring: output missing" in log and "samples," in log, log[-2000:]
    assert planned_jobs(snakemake(wf, "-n", "--until", "hidden_states_index")) == {}
