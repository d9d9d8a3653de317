"""What the verifier's full content fingerprint (common/identity.py) costs: cold (every byte
hashed) and remembered (a stat per file), extrapolated to Kimi-K2.5 INT4 (547 GB in 64 files).

    python bench/verifier_fingerprint.py --size-gb 16 --files 8 --dir /work/bench-tmp

Writes `--files` files totalling `--size-gb` GB into a fresh directory under `--dir` (refused
unless 20 GB stay free), measures, prints a markdown table and deletes the files.

The page cache: a file just written is in RAM, so hashing it measures sha256 on the CPU, not
the disk. Each file is evicted after it is written (fsync, then posix_fadvise DONTNEED: no root
needed) and again before each cold run, so "evicted" rows read from the disk as this machine
sees it (a VM's virtual disk may itself be cached by its host). The "in memory" rows are the
CPU-bound sha256 rate, what page-cache-warm hashing gets.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eagleflow.common import identity

GB = 1e9
BLOCK = 64 << 20
KIMI_BYTES, KIMI_FILES = 547 * GB, 64
MIN_FREE_BYTES = 20 * GB


def write_files(root: Path, total: int, count: int) -> list[Path]:
    """`count` weight files of `total` bytes in all: one random 64 MiB block, a counter at its
    start so that no two blocks are the same; each fsynced and evicted from the page cache."""
    block = bytearray(os.urandom(BLOCK))
    (root / "config.json").write_text(json.dumps({"model_type": "bench"}))
    files, counter = [], 0
    for i in range(count):
        path = root / f"model-{i + 1:05d}-of-{count:05d}.safetensors"
        left = total // count + (total % count if i == count - 1 else 0)
        with open(path, "wb", buffering=0) as fh:
            while left > 0:
                struct.pack_into("<Q", block, 0, counter)
                counter += 1
                n = fh.write(memoryview(block)[: min(left, BLOCK)])
                left -= n
            os.fsync(fh.fileno())
        evict(path)
        files.append(path)
    return files


def evict(path: Path) -> None:
    """Drop a file's clean pages from the page cache (a no-op where the kernel ignores it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def timed(fn: Callable[[], object], evicted: Sequence[Path] = ()) -> float:
    """Seconds `fn` takes, with `evicted` files out of the page cache first."""
    for path in evicted:
        evict(path)
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def read_all(files: list[Path]) -> None:
    """dd-style: read every byte, hash nothing."""
    buf = bytearray(identity.BLOCK_BYTES)
    for path in files:
        with open(path, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


def sha256_in_memory(nbytes: int, threads: int) -> float:
    """Seconds for `threads` threads to each sha256 `nbytes` of one in-memory buffer."""
    data = memoryview(os.urandom(identity.BLOCK_BYTES))

    def one() -> None:
        h = hashlib.sha256()
        for _ in range(nbytes // len(data)):
            h.update(data)

    workers = [threading.Thread(target=one) for _ in range(threads)]
    started = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return time.perf_counter() - started


def cold(files: list[Path], threads: int) -> float:
    """Seconds to hash every file from the disk, nothing remembered."""
    os.environ[identity.CACHE_ENV] = ""
    return timed(lambda: identity.file_digests(files, threads=threads), files)


def remembered_seconds(root: Path, cache: Path) -> float:
    """Median seconds of a verifier_fingerprint whose digests are all remembered (after one
    that remembers them)."""
    os.environ[identity.CACHE_ENV] = str(cache)  # outside the verifier: it is no file of its
    time.sleep(identity.RACY_WINDOW_NS / 1e9)  # the files must be older than the racy window
    first = identity.verifier_fingerprint(root, progress=False)
    runs = []
    for _ in range(5):
        started = time.perf_counter()
        assert identity.verifier_fingerprint(root, progress=False) == first
        runs.append(time.perf_counter() - started)
    return statistics.median(runs)


def measure(files: list[Path], total: int, pool: int, repeat: int) -> list[tuple[str, int, int, list[float]]]:
    """(what, threads, bytes, seconds of each run) of each measurement, `repeat` rounds
    interleaved so that a neighbour's load spreads over all of them."""
    mem = 2 << 30
    rows: list[tuple[str, int, int, Callable[[], float]]] = [
        ("sha256 in memory (CPU bound = page-cache-warm rate)", 1, mem, lambda: sha256_in_memory(mem, 1)),
        ("sha256 in memory, a buffer per thread", pool, pool * mem, lambda: sha256_in_memory(mem, pool)),
        ("read only, evicted (dd-style disk read)", 1, total, lambda: timed(lambda: read_all(files), files)),
        ("full hash, evicted (cold)", 1, total, lambda: cold(files, 1)),
        ("full hash, evicted (cold), thread pool", pool, total, lambda: cold(files, pool)),
    ]
    runs: list[list[float]] = [[] for _ in rows]
    for _ in range(repeat):
        for i, (*_, run) in enumerate(rows):
            runs[i].append(run())
    return [(what, threads, nbytes, runs[i]) for i, (what, threads, nbytes, _) in enumerate(rows)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, required=True, help="total size of the weight files, GB (1e9 bytes)")
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--dir", type=Path, required=True, help="where to write them (a fresh folder inside)")
    ap.add_argument("--repeat", type=int, default=2, help="rounds of each measurement; the fastest is shown")
    args = ap.parse_args()
    total = int(args.size_gb * GB)
    args.dir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(args.dir).free
    if free - total < MIN_FREE_BYTES:
        sys.exit(
            f"{args.dir}: {free / GB:.1f} GB free; writing {total / GB:.1f} GB would leave less than "
            f"{MIN_FREE_BYTES / GB:.0f} GB: pass a smaller --size-gb or another --dir"
        )
    cpus = len(os.sched_getaffinity(0))
    pool = min(args.files, identity.MAX_THREADS, cpus)
    root = Path(tempfile.mkdtemp(prefix="fingerprint-bench-", dir=args.dir))
    cache = root.with_name(f"{root.name}-digests.json")
    load_before = os.getloadavg()[0]
    try:
        write_s = timed(lambda: write_files(root, total, args.files))
        files = sorted(root.glob("*.safetensors"))
        rows = measure(files, total, pool, args.repeat)
        remembered = remembered_seconds(root, cache)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        cache.unlink(missing_ok=True)
    report(args, total, write_s, cpus, pool, rows, remembered, (load_before, os.getloadavg()[0]))


def report(
    args: argparse.Namespace,
    total: int,
    write_s: float,
    cpus: int,
    pool: int,
    rows: list[tuple[str, int, int, list[float]]],
    remembered: float,
    load: tuple[float, float],
) -> None:
    """The markdown table, rates from the fastest of each measurement's runs."""
    print(
        f"{args.files} files, {total / GB:.1f} GB, written in {write_s:.1f} s; {cpus} CPUs (load average "
        f"{load[0]:.1f} before, {load[1]:.1f} after); thread pool of {pool}; reads of "
        f"{identity.BLOCK_BYTES >> 20} MiB; fastest of {args.repeat} runs each\n"
    )
    kimi = f"{KIMI_BYTES / GB:.0f} GB ({KIMI_FILES} files) at this rate"
    print(f"| measured | threads | GB | s (each run) | GB/s | {kimi} |")
    print("|---|---:|---:|---:|---:|---:|")
    for what, threads, nbytes, seconds in rows:
        rate = nbytes / min(seconds)
        each = ", ".join(f"{s:.2f}" for s in seconds)
        print(
            f"| {what} | {threads} | {nbytes / GB:.1f} | {each} | {rate / GB:.2f} | "
            f"{KIMI_BYTES / rate:.0f} s ({KIMI_BYTES / rate / 60:.1f} min) |"
        )
    per_file = remembered / (args.files + 1)  # the weight files and config.json
    print(
        f"| remembered: a second verifier_fingerprint, a stat per file (median of 5) | - | {total / GB:.1f} | "
        f"{remembered:.4f} | - | {per_file * (KIMI_FILES + 1) * 1e3:.1f} ms (per-file cost x {KIMI_FILES + 1}) |"
    )
    r1 = rows[0][2] / min(rows[0][3])
    print(
        f"\nCPU-bound floor on a host with >= {KIMI_FILES} free cores ({KIMI_FILES} files hashed at once at "
        f"the 1-thread rate): {KIMI_BYTES / (KIMI_FILES * r1):.0f} s; the storage's read rate decides above it."
    )


if __name__ == "__main__":
    main()
