"""eagleflow deployed the way the Snakemake workflow catalog deploys a workflow: a directory
of the user's own with a `config/` and a `workflow/Snakefile` that imports eagleflow as a
`module` (what `snakedeploy deploy-workflow` writes, with the checkout's path in place of
github()), and a config of the user's own (their prompt file). The dry run plans every stage,
a cheap target builds from the user's prompts, and a second workflow that uses eagleflow's
rules beside a rule of its own runs both. The package installed from a wheel, as the README's
`pip install` gives it to a deployed workflow, finds its config schema."""

import json
import shutil
import subprocess
import sys
import zipfile

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


USER_PROMPTS = 40


def deploy(dst, snakefile: str, run: str):
    """The user's directory: config/ as snakedeploy copies it, then made the user's own (a run
    name and a prompt file of theirs, a path relative to their directory)."""
    shutil.copytree(REPO / "config", dst / "config")
    mine = [
        {"id": f"mine-{i:03d}", "category": "mine", "turns": [f"What is {i} plus {i}?"]} for i in range(USER_PROMPTS)
    ]
    (dst / "config/prompts/mine.jsonl").write_text("".join(json.dumps(p) + "\n" for p in mine))
    config = yaml.safe_load((dst / "config/config.yaml").read_text())
    config["run"] = run
    config["prompts"]["source"] = "config/prompts/mine.jsonl"
    (dst / "config/config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    (dst / "workflow").mkdir()
    (dst / "workflow/Snakefile").write_text(snakefile)
    return dst


def prompt_ids(path) -> list[str]:
    return [json.loads(line)["id"] for line in path.read_text().splitlines()]


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
    prompts = wf / "results/deployed/prompts"
    ids = prompt_ids(prompts / "train.jsonl") + prompt_ids(prompts / "eval.jsonl")
    assert sorted(ids) == [f"mine-{i:03d}" for i in range(USER_PROMPTS)]  # the user's prompts, all of them
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


def test_the_installed_package_finds_its_config_schema(tmp_path):
    """A deployed workflow imports eagleflow from where pip put it, not from a checkout: the
    wheel carries the schema the Snakefile validates every config against at parse time."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", tmp_path, REPO],
        check=True,
        cwd=tmp_path,
        capture_output=True,
        timeout=600,
    )
    (wheel,) = tmp_path.glob("eagleflow-*.whl")
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    assert not (site / "eagleflow/config.schema.yaml").is_symlink()
    check = (
        "import sys, yaml, eagleflow\n"
        "from eagleflow.common.config import ConfigError, validate_config\n"
        "assert eagleflow.__file__.startswith(sys.argv[1]), eagleflow.__file__\n"
        "config = yaml.safe_load(open(sys.argv[2]))\n"
        "validate_config(config)\n"
        "config['train']['epochs'] = 'eight'\n"
        "try:\n"
        "    validate_config(config)\n"
        "except ConfigError as e:\n"
        "    print('refused:', e)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", check, str(site), str(REPO / "config/config.yaml")],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "refused:" in proc.stdout and "epochs" in proc.stdout
