"""`python -m eagleflow.runtime.supervise (--parent PID | --shared DIR --linger S) --grace S -- CMD...`:
run CMD so that it cannot outlive the process(es) that asked for it.

A server runs in its own process group, so that stopping it also stops the engine and
worker processes it forks. Nothing stops such a group when the job that launched it dies
without running its cleanup (SIGKILL, an OOM kill, `kill -9` of Snakemake's process group):
the server would keep its port and, on a GPU host, every GPU's memory. This supervisor is
that group's leader. It asks the kernel for a signal when its parent dies (Linux
PR_SET_PDEATHSIG, which SIGKILL of the parent triggers too) and then stops the rest of the
group: SIGTERM, and SIGKILL after the grace period. It does the same when CMD exits on its
own (a crash leaves no engine process behind). CMD gets the same parent-death signal with the
supervisor as its parent, so even a supervisor killed outright takes CMD down (CMD's own
children are then left to the lease check of the next job, see runtime.leases).

A server that several jobs share (`--shared DIR`, see runtime.shared_server) outlives the job that
launched it. Its supervisor does not follow a parent but the consumers registered in DIR:
once none has been alive for `--linger` seconds it takes DIR's lock (so that no job attaches
meanwhile), forgets the server and stops the group. Jobs that die without unregistering count
as gone, so a hard-killed run leaves such a server behind for at most the linger time.

Directories named with `--scratch` are CMD's alone (files a server writes for its clients to
read and delete): the supervisor removes them once it has stopped CMD because it was asked to
(SIGTERM, the linger time), so that files no client will read (a killed client's) do not
outlive the server. After a crash they stay: the clients that restart the server still read
what it wrote before it died.

The supervisor exits with CMD's exit status (negative signal numbers as 128 + n), so its
launcher sees vLLM's status as if it had started vLLM itself.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time

from eagleflow.runtime.process import group_members
from eagleflow.runtime.shared_server import SharedDir

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int) -> None:
    """Ask Linux to send `sig` to this process when its parent exits."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def stop_others(grace_s: float) -> None:
    """SIGTERM every other member of this process group; SIGKILL those left after `grace_s`."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the group signal reaches us too
    pgid = os.getpgid(0)
    os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and _others(pgid):
        time.sleep(0.2)
    for pid in _others(pgid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _others(pgid: int) -> list[int]:
    """Live processes of group `pgid` other than this one (our exited children reaped)."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    return [pid for pid in group_members(pgid) if pid != os.getpid()]


def remove_scratch(paths: list[str]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    owner = ap.add_mutually_exclusive_group(required=True)
    owner.add_argument("--parent", type=int, help="pid of the launching process")
    owner.add_argument("--shared", help="the shared server's directory (runtime.shared_server.SharedDir)")
    ap.add_argument("--linger", type=float, default=60.0, help="with --shared: seconds without consumers")
    ap.add_argument("--grace", type=float, required=True, help="seconds between SIGTERM and SIGKILL")
    ap.add_argument("--scratch", action="append", default=[], help="a directory to remove once CMD is stopped")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        ap.error("no command given")

    stopping = False

    def on_term(signum, frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)
    shared = SharedDir(args.shared) if args.shared else None
    if shared is None:
        die_with_parent(signal.SIGTERM)
        if os.getppid() != args.parent:  # the parent died before the kernel could be asked
            return 128 + signal.SIGTERM
    child = subprocess.Popen(cmd, preexec_fn=lambda: die_with_parent(signal.SIGKILL))
    code = None
    idle_since = None
    while not stopping and code is None:
        code = child.poll()
        time.sleep(0.2 if shared is None else 1.0)
        if shared is not None and code is None and not stopping:
            idle_since = None if shared.live_consumers() else (idle_since or time.monotonic())
            if idle_since is not None and time.monotonic() - idle_since >= args.linger:
                with shared.locked():  # nobody attaches while the server goes away
                    if not shared.live_consumers():
                        shared.clear_state(os.getpid())
                        stop_others(args.grace)
                        remove_scratch(args.scratch)
                        shared.write_exit(os.getpid(), 0)
                        return 0
                idle_since = None
    # Whether CMD ended or we were told to stop: nothing of the group outlives the supervisor.
    stop_others(args.grace)
    if code is None:  # stopped on request, not crashed
        remove_scratch(args.scratch)
    status = 128 + signal.SIGTERM if code is None else (code if code >= 0 else 128 - code)
    if shared is not None:
        shared.write_exit(os.getpid(), status)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
