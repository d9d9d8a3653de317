"""Snakemake runs of a workflow copy: what a dry run plans, and copies of the workflow (and of
a finished run) to run in isolation."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def planned_jobs(dry_run_stdout: str) -> dict[str, str]:
    """{rule: its `reason:` line} for every job a `snakemake -n` run lists ("all" included)."""
    plan, rule = {}, None
    for line in dry_run_stdout.splitlines():
        if line.startswith(("rule ", "localrule ")):
            rule = line.split()[-1].rstrip(":")
            plan[rule] = ""
        elif rule and line.strip().startswith("reason:"):
            plan[rule] = line.strip().removeprefix("reason: ")
    return plan


@dataclass(frozen=True)
class FinishedRun:
    """A finished run as the bench scripts read it: the workflow directory, its config merged
    over config/config.yaml with the given config files, results/<run>, the prepared verifier."""

    workdir: Path
    config: dict[str, Any]
    run: Path
    verifier: str

    @classmethod
    def of(cls, workdir: Path, configfiles: list[str]) -> FinishedRun:
        from eagleflow.dag.plan.needs import load_merged_config

        workdir = workdir.resolve()
        config = load_merged_config(configfiles, workdir)
        verifier = str(workdir / "resources/verifier" / config["verifier"]["name"])
        return cls(workdir, config, workdir / "results" / config["run"], verifier)


# What a run directory holds of the repository.
WORKFLOW_FILES = ("workflow", "config", "profiles")


def copy_workflow(dst: Path) -> Path:
    """A copy of the workflow (Snakefile, rules, config, package) to run in isolation."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in WORKFLOW_FILES:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dst / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, dst / name)
    return dst


def copy_finished_run(src: Path, dst: Path) -> Path:
    """A copy of a finished run (tests/integration/conftest.py: finished_run) at `dst`, mtimes
    kept, with this checkout's code: an edit a test of another worker has in flight in the
    shared run (tests/integration/test_pipeline.py edits modules and restores them) never
    travels."""
    shutil.copytree(src, dst, symlinks=True)
    for name in WORKFLOW_FILES:
        (shutil.rmtree if (dst / name).is_dir() else os.unlink)(dst / name)
    return copy_workflow(dst)
