"""eagleflow deployed the way the Snakemake workflow catalog deploys a workflow: a directory
of the user's own with a `config/` and a Snakefile that imports eagleflow as a `module`
(what `snakedeploy deploy-workflow` writes, with the checkout's path in place of github()).
The dry run plans every stage, a cheap target builds, and a second workflow that uses
eagleflow's rules beside a rule of its own runs both."""

import shutil
import subprocess
import sys

import yaml

from devkit.runs import planned_jobs
from tests.helpers import REPO

SNAKEMAKE = [sys.executable, "-m", "snakemake"]
# Every rule of eagleflow's DAG but the optional write_prompts, read from its rule files.
STAGES = {
    line.split()[1].rstrip(":")
    for smk in (REPO / "workflow/rules").glob("*.smk")
    for line in smk.read_text().splitlines()
    if line.startswith("rule ")
} - {"write_prompts"}

# What snakedeploy writes, with the checkout's path in place of github(...).
MODULE = f"""\
configfile: "config/config.yaml"


module eagleflow:
    snakefile:
        "{REPO / "workflow/Snakefile"}"
    config:
        config
"""
DEPLOYED = (
    MODULE
    + """

use rule * from eagleflow
"""
)

# The user's own pipeline: eagleflow's rules under a prefix, and a rule of its own that
# reads one of eagleflow's outputs.
EXTENDED = (
    MODULE
    + """

rule all:
    input:
        "results/extended/prompt_count.txt",


use rule * from eagleflow as eagleflow_*


rule count_prompts:
    input:
        "results/extended/prompts/train.jsonl",
    output:
        "results/extended/prompt_count.txt",
    shell:
        "wc -l < {input} > {output}"
"""
)


def deploy(dst, snakefile: str, run: str):
    """The user's directory: config/ as snakedeploy copies it, with a run name of its own."""
    shutil.copytree(REPO / "config", dst / "config")
    config = yaml.safe_load((dst / "config/config.yaml").read_text())
    config["run"] = run
    (dst / "config/config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    (dst / "Snakefile").write_text(snakefile)
    return dst


def snakemake(wf, *args) -> subprocess.CompletedProcess:
    proc = subprocess.run([*SNAKEMAKE, *args], cwd=wf, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def test_a_deployed_module_plans_every_stage_and_builds_a_target(tmp_path):
    wf = deploy(tmp_path / "deployed", DEPLOYED, "deployed")
    plan = snakemake(wf, "-n")
    assert set(planned_jobs(plan.stdout)) >= STAGES, plan.stdout[-3000:]
    assert "Verifier loads this run takes:" in plan.stderr + plan.stdout
    snakemake(wf, "--cores", "2", "results/deployed/prompts/stats.json")
    assert (wf / "results/deployed/prompts/train.jsonl").stat().st_size > 0
    assert (wf / "results/deployed/logs/prompts.log").exists()  # the user's directory, not the checkout
    assert not (REPO / "results/deployed").exists()


def test_a_workflow_uses_eagleflows_rules_beside_its_own(tmp_path):
    wf = deploy(tmp_path / "extended", EXTENDED, "extended")
    plan = planned_jobs(snakemake(wf, "-n").stdout)
    assert {"count_prompts", "eagleflow_prompts"} <= set(plan), plan
    assert "eagleflow_train" not in plan  # only what its own target needs
    snakemake(wf, "--cores", "2")
    count = int((wf / "results/extended/prompt_count.txt").read_text())
    assert count == len((wf / "results/extended/prompts/train.jsonl").read_text().splitlines()) > 0
