"""What a run sends through a bucket (docs/operations.md, "Without a shared filesystem"), and
what a link of a given speed costs in hours: the plan's section for a run whose hidden states
lie in a bucket (`storage.states`, or `--default-storage-provider s3`).

The states dominate: the extraction uploads each new sample once; training fetches every
sample once per epoch unless its processes' caches (`storage.cache_gb` each) hold them all,
and prefetches a batch ahead, so the link either keeps up with the steps or training waits on
it. The drafts go up once each, and each checkpoint as it is written (storage.checkpoints, the
provider's default: a job resubmitted elsewhere resumes from it); what else the run stores
(prompts, replies, the dataset, logs) is a fraction of a gigabyte per 10,000 samples.
"""

from __future__ import annotations

import math
from typing import Any

from eagleflow.dag.plan.hours import HOUR, Rates, Training, Work

GB = 1e9


def link_hours(nbytes: float, gbps: float) -> float:
    """Hours `nbytes` take through a `gbps` gigabit-per-second link. Pure."""
    return nbytes * 8 / (gbps * 1e9) / 3600


def bucket_rows(
    config: dict[str, Any],
    new_states: int,
    all_states: int,
    drafts: dict[str, tuple[dict[str, Any], int]],
    export_bytes: dict[str, int],
    train_hours: dict[str, float | None],
    gbps: float,
    checkpoints: dict[str, tuple[int, int]] | None = None,
) -> list[dict[str, Any]]:
    """[{stage, what, up, down, hours, note}] through the bucket at `gbps`. `new_states`: the
    bytes the extraction uploads; `all_states`: every sample's, what training reads;
    `train_hours`: each draft's training time (None: unknown); `checkpoints`: each draft's
    (checkpoints written, bytes of one). Pure."""
    storage = config["storage"]
    rows = [
        {
            "stage": "hidden_states",
            "what": "each new sample uploaded once",
            "up": new_states,
            "down": 0,
        }
    ]
    for label, (train, _vocab) in drafts.items():
        cache = storage["cache_gb"] * GB * train["nproc_per_node"]
        epochs = Training.of(train).passes
        passes = 1 if cache >= all_states else epochs
        down = all_states * passes
        count, each = (checkpoints or {}).get(label, (0, 0))
        row = {
            "stage": "train",
            "what": f"{label}the states read {passes:g}x ({epochs:g} epochs; caches of {cache / GB:.0f} GB "
            + ("hold them all" if passes == 1 else "hold a fraction")
            + "), the draft uploaded"
            + (f", {count} checkpoints of {each / GB:.1f} GB copied" if count else ""),
            "up": export_bytes[label] + count * each,
            "down": down,
        }
        hours = train_hours.get(label)
        if hours:
            need = down * 8 / (hours * HOUR) / 1e9
            row["note"] = (
                f"{label}training reads at {need:.1f} Gb/s on average: the link keeps up"
                if need <= gbps
                else f"{label}training needs {need:.1f} Gb/s: it waits on the link, "
                f"{link_hours(down, gbps) - hours:.1f} h at least; storage.cache_gb "
                f"{all_states / train['nproc_per_node'] / GB:.0f} (per process, on a disk that holds it) reads "
                "the states once"
            )
        rows.append(row)
    for r in rows:
        r["hours"] = link_hours(r["up"] + r["down"], gbps)
    return rows


def bucket_section(
    config: dict[str, Any],
    new_states: int,
    all_states: int,
    drafts: dict[str, tuple[dict[str, Any], int]],
    export_bytes: dict[str, int],
    work: Work,
    rates: Rates,
    gbps: float,
    checkpoint_bytes: dict[str, int] | None = None,
) -> str:
    """The plan's section: bucket_rows with each draft's training hours at `rates`, and its
    checkpoints (one of `checkpoint_bytes[label]` every `checkpoint_every` of its steps, a
    step being `batch_tokens` on each of its processes). Pure."""
    hours, checkpoints = {}, {}
    for label, (train, _vocab) in drafts.items():
        rate = rates.train_rate(train["method"])
        hours[label] = None if rate is None else work.tokens * Training.of(train).passes / rate / HOUR
        steps = math.ceil(work.tokens * Training.of(train).passes / (train["batch_tokens"] * train["nproc_per_node"]))
        every = train["checkpoint_every"]
        checkpoints[label] = (steps // every if every else 0, (checkpoint_bytes or {}).get(label, 0))
    rows = bucket_rows(config, new_states, all_states, drafts, export_bytes, hours, gbps, checkpoints)
    return render_bucket(rows, gbps)


def render_bucket(rows: list[dict[str, Any]], gbps: float) -> str:
    """The rows as Markdown. Pure."""
    lines = [
        f"Through the bucket (a {gbps:g} Gb/s link):",
        "",
        "| stage | what | up | down | hours |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['stage']} | {r['what']} | {r['up'] / GB:.2f} GB | {r['down'] / GB:.2f} GB | {r['hours']:.2f} h |"
        for r in rows
    ]
    notes = [f"- {r['stage']}: {r['note']}" for r in rows if r.get("note")]
    return "\n".join([*lines, "", *notes]).rstrip() + "\n"
