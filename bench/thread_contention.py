"""Two torch jobs at once on a small machine: each with every CPU's thread, or each pinned to
its own share of the CPUs (what `make test`'s workers do, tests/conftest.py).

    python bench/thread_contention.py [--seconds 15]

A job is a loop of small matrix products (a draft layer's shape). Reported: iterations per
second of one job alone with every CPU, then of two jobs at once, both with every CPU, and
both pinned to half of them with as many threads as CPUs they may run on
(runtime.smk.stage caps a job's threads so).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time


def job(seconds: float, cpus: list[int] | None, out: mp.Queue) -> None:
    """Matrix products for `seconds`, on `cpus` (None: wherever), one thread per CPU allowed."""
    import torch

    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    a, w = torch.randn(96, 576), torch.randn(576, 1536)
    started, n = time.perf_counter(), 0
    while time.perf_counter() - started < seconds:
        for _ in range(50):
            (a @ w).relu_()
        n += 50
    out.put(n / (time.perf_counter() - started))


def run(seconds: float, placements: list[list[int] | None]) -> list[float]:
    """Iterations/s of one job per placement, all started at once."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=job, args=(seconds, cpus, out)) for cpus in placements]
    for p in procs:
        p.start()
    rates = [out.get() for _ in procs]
    for p in procs:
        p.join()
    return sorted(rates)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=15.0)
    args = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    halves = [cpus[0::2], cpus[1::2]]
    alone = run(args.seconds, [None])
    shared = run(args.seconds, [None, None])
    pinned = run(args.seconds, halves)
    print(
        json.dumps(
            {
                "cpus": len(cpus),
                "alone_all_cpus": alone,
                "two_jobs_all_cpus_each": shared,
                "two_jobs_pinned_to_halves": pinned,
                "total_pinned_over_total_shared": sum(pinned) / sum(shared),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
