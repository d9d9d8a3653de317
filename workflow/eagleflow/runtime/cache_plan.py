"""The plan's side of the output cache (runtime.output_cache): which planned jobs may be
restored. Snakemake knows why it plans a job (forced, an output missing, an input rewritten,
code or params changed); a job does not. So once Snakemake has planned a run, each planned job
of a cached rule is marked (`.snakemake/eagleflow/recompute/`) when it must recompute (forced
or an output missing) and unmarked otherwise; the job reads its mark before it restores, and
clears it once it has recomputed. `snakemake -n` prints the same decision, per rule.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# "off": recompute every planned job (entries are still kept); "missing": a missing output may
# be restored too (a rerun after a failed SLURM group job, whose finished parity jobs' outputs
# Snakemake removed with the failed one); anything else: forced jobs and missing outputs recompute.
SWITCH = "EAGLEFLOW_OUTPUT_CACHE"
RESTORE_MISSING = "missing"
# Where the plan marks the jobs that must recompute, relative to the workflow's working directory
# (shared with the jobs, on a cluster too: .snakemake sits there).
MARKS = Path(".snakemake/eagleflow/recompute")
MANIFEST = ".manifest.json"  # in an entry: each kept file's sha256 and the outputs it restores
# The blocker of a job the user forced.
FORCED = "forced (-R/--forcerun/--forceall/-f)"
# Rules whose jobs keep their outputs in the cache (the plan marks only those).
CACHED_RULES = frozenset({"hidden_states", "train", "baseline", "benchmark", "parity"})
# Of those, the rules whose jobs keep per-item results in a store of their own instead of
# entries (runtime/state_store.py): they compute only what the store lacks unless
# forced (recomputes_all).
STORE_RULES = frozenset({"hidden_states"})


def entry_location(rule: str, outputs: Sequence[str | os.PathLike]) -> tuple[Path, str]:
    """(directory, slot) of the entries a job of cached `rule` keeps, from its outputs in the
    rule's order: a draft's in its train/done/ (beside its metrics, the second output); the
    other rules' beside their first output, by the rule (hidden_states keeps none: its store
    is its cache, STORE_RULES). Pure."""
    first = Path(outputs[0])
    if rule == "train":
        return Path(outputs[1]).parent / "done", "draft"
    return first.parent / ".done", rule


def kept_keys(rule: str, outputs: Sequence[str | os.PathLike]) -> list[str]:
    """The keys the cache holds for this job's slot (at most one: keeping a key drops the
    slot's others)."""
    directory, slot = entry_location(rule, outputs)
    if not directory.is_dir():
        return []
    return [p.name[len(slot) + 1 :] for p in directory.glob(f"{slot}.*") if (p / MANIFEST).is_file()]


def cache_enabled() -> bool:
    return os.environ.get(SWITCH, "on").strip().lower() not in ("off", "0", "false", "no")


def restores_missing() -> bool:
    return os.environ.get(SWITCH, "on").strip().lower() == RESTORE_MISSING


def cached_rule(name: str) -> str | None:
    """The cached rule a Snakemake rule is, also when a workflow imports eagleflow as a module
    under a prefix (`use rule * from eagleflow as eagleflow_*`); None for any other rule."""
    for rule in CACHED_RULES:
        if name == rule or name.endswith("_" + rule):
            return rule
    return None


def _mark_path(outputs: Iterable[str | os.PathLike]) -> Path:
    first = sorted(os.path.normpath(str(o)) for o in outputs)[0]
    return MARKS / hashlib.sha256(first.encode()).hexdigest()[:24]


def recompute_reason(outputs: Iterable[str | os.PathLike]) -> str | None:
    """Why the plan said this job (by its outputs) must recompute, or None."""
    path = _mark_path(outputs)
    try:
        return path.read_text().strip() or "marked by the plan"
    except FileNotFoundError:
        return None


def recomputes_all(reason: str | None) -> bool:
    """Whether a job whose mark says `reason` (recompute_reason) must redo all its work, as a
    job that keeps per-item results (the hidden-state store) reads it: the user forced it, or
    the cache is off, in this process or in the plan that marked the job (a cluster job's
    environment may not carry the switch). A missing output alone is not a reason: its items
    are still stored."""
    return not cache_enabled() or (reason is not None and (FORCED in reason or reason == f"{SWITCH}=off"))


def clear_mark(outputs: Iterable[str | os.PathLike]) -> None:
    """The job recomputed its outputs: a later plan decides afresh."""
    _mark_path(outputs).unlink(missing_ok=True)


def restore_blockers(reason: Any, missing_blocks: bool = True) -> list[str]:
    """Why a job Snakemake planned must not be restored, from its Snakemake `reason`: the user
    forced it, or (with `missing_blocks`) an output is missing: deleted, or removed with a
    failed job. Other reasons (an input rewritten, code, params or software env changed)
    leave it to the key. Pure."""
    why = []
    if getattr(reason, "forced", False):
        why.append(FORCED)
    missing = getattr(reason, "missing_output", None)
    if missing and missing_blocks:
        why.append("output missing: " + ", ".join(sorted(map(str, missing))[:2]))
    incomplete = getattr(reason, "incomplete_output", None)
    if incomplete:
        why.append("output incomplete: " + ", ".join(sorted(map(str, incomplete))[:2]))
    return why


@dataclass(frozen=True)
class PlannedJob:
    rule: str
    outputs: tuple[str, ...]
    blockers: tuple[str, ...]
    kept: bool = False  # the cache holds an entry for the job's slot (restored if its key matches)


def planned_cache_jobs(dag: Any) -> list[PlannedJob]:
    """The jobs of cached rules that Snakemake's `dag` will run, with what blocks a restore."""
    jobs = []
    for job in dag.needrun_jobs():
        rule = cached_rule(job.rule.name)
        if rule is not None:
            blockers = restore_blockers(dag.reason(job), missing_blocks=not restores_missing())
            outputs = tuple(map(str, job.output))
            jobs.append(PlannedJob(rule, outputs, tuple(blockers), bool(kept_keys(rule, outputs))))
    return jobs


def mark_planned_jobs(jobs: Iterable[PlannedJob]) -> None:
    """Mark (or unmark) each planned job: only this plan decides whether it may be restored."""
    for job in jobs:
        path = _mark_path(job.outputs)
        if job.blockers or not cache_enabled():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("; ".join(job.blockers) or f"{SWITCH}=off")
        else:
            path.unlink(missing_ok=True)


def describe_cache_plan(jobs: list[PlannedJob]) -> str | None:
    """The line `snakemake -n` prints: which planned jobs recompute (forced, an output
    missing, the cache off), which have no entry to restore (they compute), and which have one
    (restored when their key, computed in the job from its inputs, is the entry's). Pure."""
    if not jobs:
        return None
    kept: dict[str, int] = {}
    none_kept: dict[str, int] = {}
    stored: dict[str, int] = {}
    recompute: dict[str, list[str]] = {}
    for job in jobs:
        if job.rule in STORE_RULES and not recomputes_all("; ".join(job.blockers)):
            stored[job.rule] = stored.get(job.rule, 0) + 1
        elif job.blockers or not cache_enabled():
            recompute.setdefault(job.rule, []).append(job.blockers[0].split(":")[0] if job.blockers else "cache off")
        elif job.kept:
            kept[job.rule] = kept.get(job.rule, 0) + 1
        else:
            none_kept[job.rule] = none_kept.get(job.rule, 0) + 1
    parts = []
    if recompute:
        parts.append(
            "recomputed: "
            + ", ".join(f"{rule} {len(why)} ({'; '.join(sorted(set(why)))})" for rule, why in recompute.items())
        )
    if none_kept:
        parts.append("computed (no entry kept): " + ", ".join(f"{rule} {n}" for rule, n in none_kept.items()))
    if stored:
        parts.append("compute only what their store lacks: " + ", ".join(f"{r} {n}" for r, n in stored.items()))
    if kept:
        parts.append("restored if their key matches the entry kept: " + ", ".join(f"{r} {n}" for r, n in kept.items()))
    return "Output cache: " + "; ".join(parts)


def plan_cache(dag: Any, mark: bool) -> str | None:
    """Called once Snakemake has planned its jobs (workflow/rules/common.smk): the line that says
    which jobs recompute and which may be restored, and with `mark` (a real run, not a dry
    one) the marks the jobs read. A plan that cannot be marked switches the cache off for
    this run's jobs rather than let a forced job be restored."""
    jobs = planned_cache_jobs(dag)
    if mark:
        try:
            mark_planned_jobs(jobs)
        except OSError as exc:
            log.warning("cannot mark the planned jobs in %s (%s): output cache off for this run", MARKS, exc)
            os.environ[SWITCH] = "off"
    return describe_cache_plan(jobs)
