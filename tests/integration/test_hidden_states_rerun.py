"""A part job killed before its manifest leaves only a temporary that Snakemake does not count;
the next run redoes that part and what depends on it, never the parts that finished (inside
the part, the store keeps each finished sample: tests/unit/test_hidden_states.py)."""

import subprocess
import sys

from devkit.runs import copy_workflow
from tests.helpers import REPO

SNAKEMAKE = [sys.executable, "-m", "snakemake", "--configfile", str(REPO / "tests/config/small.yaml")]


def planned_jobs(wf, env) -> list[tuple[str, str]]:
    """(rule, wildcards line) of every job `snakemake -n` plans."""
    out = subprocess.run(
        SNAKEMAKE + ["-n"], cwd=wf, env=env, capture_output=True, text=True, check=True, timeout=600
    ).stdout
    jobs, rule = [], None
    for line in out.splitlines():
        if line.startswith(("rule ", "localrule ")):
            rule = line.split()[-1].rstrip(":")
            jobs.append((rule, ""))
        elif line.strip().startswith("wildcards:") and rule:
            jobs[-1] = (rule, line.strip())
    return [j for j in jobs if j[0] != "all"]


def test_only_the_killed_part_and_its_downstream_rerun(tmp_path, clean_env):
    wf = copy_workflow(tmp_path)
    # Every output of the DAG as a placeholder, then --touch so Snakemake records them as
    # produced by a finished run (no vLLM, no model: this is about the DAG and the files).
    summary = subprocess.run(
        SNAKEMAKE + ["--summary", "--cores", "1"],
        cwd=wf,
        env=clean_env,
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    ).stdout
    for line in summary.splitlines()[1:]:
        path, _, rule = line.split("\t")[:3]
        target = wf / path
        if rule == "prepare_verifier" or path.endswith("/draft"):
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text("placeholder\n")
    subprocess.run(
        SNAKEMAKE + ["--touch", "--cores", "1"],
        cwd=wf,
        env=clean_env,
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    assert planned_jobs(wf, clean_env) == []

    # The state a SIGKILLed part job leaves: its manifest's write never reached the rename, so
    # only the temporary next to the target exists, and nothing downstream was made.
    hs = wf / "results/small/hidden_states"
    (hs / "part-00000.json").unlink()
    partial = hs / ".part-00000.json.killed.tmp"
    partial.mkdir()
    (partial / "part-00000.json").write_text('{"half": ')
    for done_downstream in (
        "hidden_states/index.json",
        "drafts/default/train/metrics.jsonl",
        "variants/default/benchmark/report.json",
        "variants/default/parity/report.json",
        "variants/default/report/report.md",
        "report.md",
    ):
        (wf / "results/small" / done_downstream).unlink()

    jobs = planned_jobs(wf, clean_env)
    assert [j for j in jobs if j[0] == "hidden_states"] == [("hidden_states", "wildcards: states_part=00000")]
    assert {rule for rule, _ in jobs} == {
        "hidden_states",
        "hidden_states_index",
        "train",
        "benchmark",
        "parity",
        "report",
        "compare",
        "best_draft",
    }
