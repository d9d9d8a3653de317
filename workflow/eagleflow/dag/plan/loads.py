"""Verifier loads a run will take, planned from the jobs Snakemake will run (the loads it
took are counted in runtime.ledger). A load is a start of the verifier: a vLLM server, or the
hf backend's extraction server.

On the target host one load of Kimi-K2.5 INT4 takes about 22 minutes: the count is what a
fix or a retrain costs before any work starts. docs/operations.md has the table per config.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

# The rules whose jobs share one server per run, and what their jobs are called.
SHARED = {"parity": "parity"}


LOADING_RULES = ("write_prompts", "generate", "hidden_states", "train", "baseline", "benchmark", "parity")


def by_eagleflow_rule(jobs: dict[str, int]) -> dict[str, int]:
    """`jobs` with the names a workflow gave eagleflow's rules when it imported them as a module
    under a prefix (`use rule * from eagleflow as eagleflow_*`) back to eagleflow's own. Pure."""
    out: dict[str, int] = {}
    for name, n in jobs.items():
        rule = next((r for r in LOADING_RULES if name == r or name.endswith("_" + r)), name)
        out[rule] = out.get(rule, 0) + n
    return out


def planned_loads(jobs: dict[str, int], config: dict[str, Any]) -> dict[str, int]:
    """Loads per rule for a run of `jobs` (rule -> job count, as Snakemake plans them). Pure.

    A hidden_states job (one per node) launches its own server, and only when the sample
    store lacks some of its samples: at most one load per job. The parity jobs (the replay's
    states, computed by the same backend) share one server: one load. A stage that
    uses an already running server (`server.endpoint`, `hidden_states.vllm.endpoint`) loads
    nothing. Online (`hidden_states.mode: online`) every train job loads the verifier itself, and
    served every train job starts its extraction servers (`served.servers`; none with `served.endpoints`)."""
    jobs = by_eagleflow_rule(jobs)
    hs = config["hidden_states"]
    extraction_endpoint = hs["backend"] == "vllm" and hs["vllm"]["endpoint"]
    own_server = not config["server"]["endpoint"]
    loads = {
        # write_prompts launches the verifier as generate does; a rerun the store answers launches
        # nothing, which the plan cannot know: this is the upper bound.
        "write_prompts": jobs.get("write_prompts", 0) if own_server else 0,
        "generate": jobs.get("generate", 0) if own_server else 0,
        # An upper bound: a job whose samples the store holds starts nothing.
        "hidden_states": 0 if extraction_endpoint else jobs.get("hidden_states", 0),
        "train": jobs.get("train", 0) * (hs["served"]["servers"] if hs["mode"] == "served" else 1)
        if hs["mode"] == "online" or (hs["mode"] == "served" and not hs["served"]["endpoints"])
        else 0,
        "baseline": jobs.get("baseline", 0),
        "benchmark": jobs.get("benchmark", 0),
        # The parity jobs share one extraction server (they run back to back after the benchmarks).
        "parity": min(jobs.get("parity", 0), 1),
    }
    return {rule: n for rule, n in loads.items() if n}


def describe_planned(jobs: dict[str, int], config: dict[str, Any]) -> str:
    """The line `snakemake -n` prints. Pure."""
    jobs = by_eagleflow_rule(jobs)
    loads = planned_loads(jobs, config)
    parts = [
        f"{rule} {n}" + (f" (shared by {jobs[rule]} {SHARED[rule]} jobs)" if rule in SHARED else "")
        for rule, n in loads.items()
    ]
    return f"Verifier loads this run takes: {sum(loads.values())}" + (f" ({', '.join(parts)})" if parts else "")


class RunInfoLine(logging.Handler):
    """Prints one line once, when Snakemake logs its job statistics (the RUN_INFO event of
    its logging API: `stats` is rule -> job count), in a dry run as in a real run. `line`
    makes it from rule -> job count; None prints nothing."""

    def __init__(self, line: Callable[[dict[str, int]], str | None], emit_line: Callable[[str], None]):
        super().__init__()
        self.line = line
        self.emit_line = emit_line
        self.done = False

    def emit(self, record: logging.LogRecord) -> None:
        stats = getattr(record, "stats", None)
        if self.done or not isinstance(stats, dict):
            return
        self.done = True
        text = self.line({rule: n for rule, n in stats.items() if rule != "total"})
        if text:
            self.emit_line(text)
