"""Inspect or prune a response store.

    python -m workflow_scripts.generate stats results/demo/generate/store.sqlite
    python -m workflow_scripts.generate prune results/demo/generate/store.sqlite \
        --keep results/demo/generate/replies.parquet [more replies.parquet ...]

`prune` keeps exactly the entries that the given replies files use (the requests of their
runs) and deletes the rest; run it after a finished `generate`, when old prompts or
settings will not come back. Nothing else ever deletes a stored reply.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from workflow_scripts.common.replies import read_replies
from workflow_scripts.generate.store import ResponseStore


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workflow_scripts.generate", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("stats", "prune"):
        cmd = sub.add_parser(name)
        cmd.add_argument("store")
        cmd.add_argument(
            "--keep",
            nargs="+",
            required=name == "prune",
            default=[],
            help="replies.parquet files whose requests stay in the store",
        )
    args = parser.parse_args(argv)
    if not Path(args.store).is_file():
        parser.error(f"{args.store}: no such response store")
    keep = {row["key"] for path in args.keep for row in read_replies(path)}
    with ResponseStore(args.store) as store:
        total = len(store)
        if args.command == "stats":
            used = len(keep & store.keys()) if args.keep else None
            print(
                f"{args.store}: {total} replies"
                + (f", {used} used by {', '.join(args.keep)}" if used is not None else "")
            )
        else:
            removed = store.prune(keep)
            print(f"{args.store}: removed {removed} of {total} replies; {total - removed} kept")
    return 0


if __name__ == "__main__":
    sys.exit(main())
