"""The bench scripts behind BENCHMARKS.md's figures that need no run, no server and no GPU, each
called for real at a tiny size, so that a change to the code they drive cannot leave them broken
until the next measurement. bench/README.md says what each measures; what they print is checked
where it is exact (counts), never how fast."""

import re

from tests.helpers import run_bench


def table_rows(out: str, first_cell: str) -> list[list[str]]:
    """The cells of the Markdown rows whose first cell is `first_cell`."""
    rows = [
        [c.strip() for c in line.strip().strip("|").split("|")] for line in out.splitlines() if line.startswith("|")
    ]
    return [r for r in rows if r[0] == first_cell]


def test_optimizer_step_times_each_optimizer_on_a_small_batch():
    # eagleflow's Muon beside AdamW (torch's bf16 Muon takes minutes a step on a CPU without bf16 units)
    out = run_bench("optimizer_step.py", "--batch-tokens", 64, "--repeats", 1, "--threads", 1, "--optimizers", "muon")
    assert re.search(r"draft: 5\.09M trainable", out), out  # the demo's draft geometry
    (row,) = table_rows(out, "64")
    # forward+backward, AdamW's and Muon's steps, the whole step's ratio
    assert len(row) == 5 and all(float(cell) > 0 for cell in row[1:]), row


def test_grown_states_plan_counts_what_the_grown_run_extracts():
    out = run_bench("grown_states_plan.py", "--stored", 60, "--new", 10, "--tokens", 100)
    assert "samples 70 (60 stored, 10 new)" in out, out
    assert "tokens to extract 1,000 of 7,000" in out, out
    hours = dict(re.findall(r"hidden-state hours, (.+?): ([\d.]+)", out))
    assert float(hours["grown (the store holds the rest)"]) <= float(hours["every sample again"]), out


def test_shard_memory_reads_the_same_batches_both_ways():
    out = run_bench("shard_memory.py", "--gb", 0.002, "--hidden", 64, "--batch-tokens", 1024)
    (up,) = table_rows(out, "up front")
    (per,) = table_rows(out, "per batch")
    assert up[3] == per[3] and int(up[3]) > 0, out  # the same epoch of batches
    assert "per batch / up front: peak anonymous memory" in out


def test_dryrun_scaling_plans_the_production_example():
    out = run_bench("dryrun_scaling.py", "--shards", 2, "--samples", 20, "--repeats", 1)
    (row,) = table_rows(out, "2")
    assert int(row[1]) > 0 and row[-1] == "1.00x", out  # jobs planned; the CPU ratio against itself
