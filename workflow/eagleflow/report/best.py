"""The best draft of a run (the best_draft rule): every variant's draft ranked by one figure
vLLM measured, the winner copied to results/<run>/best/draft, the ranking and the rule that
chose it to best/choice.json.

The rule is the config's `best` section: `by` (mean_acceptance_length or speedup) read on
`cell` (a set at a temperature, `eval@T0`: the run's held-out prompts, greedy). The highest
wins; a tie goes to the variant listed first (the default draft first). Only measured figures
rank: a variant that did not measure the cell is listed as unmeasured and never wins. The
rule's inputs are the benchmark reports and the drafts, its params the section: a new
measurement or another rule chooses again, nothing else does.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from eagleflow.common.atomic import atomic_path, write_json
from eagleflow.runtime.smk import stage

BY = ("mean_acceptance_length", "speedup")


def cell_figure(report: dict[str, Any], by: str, cell: str) -> float | None:
    """`by` as the benchmark measured it in `cell` (None: not measured there). Pure."""
    if by not in BY:
        raise ValueError(f"best.by: {by!r} is none of {', '.join(BY)}")
    measured = report["cells"].get(cell)
    if measured is None:
        return None
    return measured["speedup"] if by == "speedup" else measured["speculative"]["mean_acceptance_length"]


def rank(reports: dict[str, dict[str, Any]], by: str, cell: str) -> list[dict[str, Any]]:
    """Every variant with its figure, best first; ties keep the variants' order, unmeasured
    ones come last. Pure."""
    rows = [
        {
            "variant": name,
            "method": r["method"],
            "k": r["num_speculative_tokens"],
            by: cell_figure(r, by, cell),
        }
        for name, r in reports.items()
    ]
    order = {row["variant"]: i for i, row in enumerate(rows)}
    return sorted(rows, key=lambda row: (row[by] is None, -(row[by] or 0.0), order[row["variant"]]))


def choose(reports: dict[str, dict[str, Any]], drafts: dict[str, str], by: str, cell: str) -> dict[str, Any]:
    """The choice: the rule, the ranking and the winner with its draft. Pure."""
    ranking = rank(reports, by, cell)
    if ranking[0][by] is None:
        measured = sorted(next(iter(reports.values()))["cells"])
        raise ValueError(f"best.cell: no variant measured {cell}; the benchmark measured {', '.join(measured)}")
    winner = ranking[0]["variant"]
    return {"by": by, "cell": cell, "winner": winner, "draft": drafts[winner], "ranking": ranking}


def main(smk) -> None:
    """The best_draft rule's job (workflow/rules/report.smk)."""
    with stage(smk) as log:
        variants = list(smk.params.variants)
        reports = {v: json.loads(Path(p).read_text()) for v, p in zip(variants, smk.input.reports, strict=True)}
        drafts = dict(zip(variants, smk.input.drafts, strict=True))
        choice = choose(reports, drafts, smk.params.best["by"], smk.params.best["cell"])
        with atomic_path(smk.output.draft) as tmp:
            shutil.copytree(choice["draft"], tmp)
        write_json(smk.output.choice, choice)
        log.info(
            "best draft by %s on %s: %s (%s)",
            choice["by"],
            choice["cell"],
            choice["winner"],
            "; ".join(f"{r['variant']} {r[choice['by']]}" for r in choice["ranking"]),
        )
