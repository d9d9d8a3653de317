"""Which processes a run left behind: every process that carries the run's environment marker
or works in, or runs a file from, the run's folder (a Snakemake job, a vLLM server, a SLURM
job's inner Snakemake, a Mooncake master, an S3 server), less this process and its
ancestors. `.ci/run` ends with it, so that a process a test failed to end fails CI by name
instead of living on into the next run on the same machine.

    python -m devkit.leftovers --marker EAGLEFLOW_CI_RUN=<id> --under <clone> [--grace-s 30]

Exit 0: none left. Exit 1: the leftovers, one line each (pid, working directory, command).
The test cluster's daemons (slurmctld, slurmd, munged) are not the run's once .ci/run has
stopped them; any that remain are listed like the rest.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True)
class Leftover:
    pid: int
    cwd: str
    command: str

    def __str__(self) -> str:
        return f"pid {self.pid}  cwd {self.cwd}  {self.command}"


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError, OSError):
        return None


def _link(path: Path) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


def ancestors(pid: int) -> set[int]:
    """`pid` and every process above it, up to init."""
    out = set()
    while pid > 0 and pid not in out:
        out.add(pid)
        stat = _read(PROC / str(pid) / "stat")
        if stat is None:
            break
        # The command sits in parentheses and may contain spaces; the parent pid is the second
        # field after them.
        pid = int(stat.rsplit(b")", 1)[1].split()[1])
    return out


def is_under(path: str, folder: str) -> bool:
    """Whether `path` (as /proc shows it, " (deleted)" for a removed folder) lies in `folder`. Pure."""
    path = path.removesuffix(" (deleted)")
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def matches(environ: bytes, cwd: str, exe: str, cmdline: list[str], markers: list[bytes], under: str | None) -> bool:
    """Whether a process belongs to the run: its environment holds every one of `markers`, or
    its working directory, its executable or a path on its command line lies under `under`. Pure."""
    if markers and set(markers) <= set(environ.split(b"\0")):
        return True
    if under is None:
        return False
    return is_under(cwd, under) or is_under(exe, under) or any(is_under(arg, under) for arg in cmdline[:2])


def leftovers(markers: list[str], under: str | None, exclude: set[int]) -> list[Leftover]:
    """The processes of the run still alive (`markers`: NAME=VALUE entries their environment
    holds, all of them), but those in `exclude` and kernel threads."""
    found = []
    want = [m.encode() for m in markers]
    for entry in PROC.iterdir():
        if not entry.name.isdigit() or int(entry.name) in exclude:
            continue
        cmdline = _read(entry / "cmdline")
        if not cmdline:  # a kernel thread, or gone
            continue
        args = [a.decode(errors="replace") for a in cmdline.rstrip(b"\0").split(b"\0")]
        environ = _read(entry / "environ") or b""
        cwd, exe = _link(entry / "cwd"), _link(entry / "exe")
        status = _read(entry / "status") or b""
        if b"State:\tZ" in status:  # a zombie holds nothing; its parent is the leftover
            continue
        if matches(environ, cwd, exe, args, want, under):
            found.append(Leftover(int(entry.name), cwd, " ".join(args)[:300]))
    return sorted(found, key=lambda p: p.pid)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--marker", required=True, help="NAME=VALUE every process of the run inherits")
    parser.add_argument("--under", help="the run's folder: processes working in or running from it")
    parser.add_argument("--grace-s", type=float, default=30.0, help="how long processes may take to end")
    args = parser.parse_args(argv)
    under = str(Path(args.under).resolve()) if args.under else None
    exclude = ancestors(os.getpid())
    deadline = time.monotonic() + args.grace_s
    while True:
        found = leftovers([args.marker], under, exclude)
        if not found or time.monotonic() >= deadline:
            break
        time.sleep(1)
    if not found:
        print(f"leftovers: no process of this run is alive ({args.marker})")
        return 0
    print(f"leftovers: {len(found)} process(es) of this run still alive after {args.grace_s:.0f} s:", file=sys.stderr)
    for p in found:
        print(f"  {p}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
