"""Inspect or prune a response store.

    python -m eagleflow.generate stats results/demo/generate/store.sqlite
    python -m eagleflow.generate prune results/demo/generate/store.sqlite \
        --keep results/demo/generate/replies.parquet results/demo/prompts/written.jsonl [more ...]

`prune` keeps exactly the entries that the given files use (the requests of generate's
replies.parquet, and of write_prompts' written.jsonl when the verifier writes prompts) and
deletes the rest; run it after a finished `generate`, when old prompts or settings will not
come back. Nothing else ever deletes a stored reply. Both act on every file of the store: the
configured one and its shards' (`<store>.<i>-of-<n>.sqlite`, runtime/response_store.py).
"""

from __future__ import annotations

import argparse
import sys

from eagleflow.common.atomic import read_jsonl
from eagleflow.common.replies import read_replies
from eagleflow.runtime.response_store import LOCKING, ResponseStore, store_files


def used_keys(path: str) -> set[str]:
    """The store keys of the requests a replies.parquet or written.jsonl file was made from."""
    if path.endswith(".jsonl"):
        return {key for row in read_jsonl(path) for key in row["keys"]}
    return {row["key"] for row in read_replies(path)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagleflow.generate", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("stats", "prune"):
        cmd = sub.add_parser(name)
        cmd.add_argument("store")
        cmd.add_argument(
            "--keep",
            nargs="+",
            required=name == "prune",
            default=[],
            help="replies.parquet (generate) and written.jsonl (write_prompts) files whose requests stay in the store",
        )
        cmd.add_argument(
            "--locking",
            choices=LOCKING,
            default="auto",
            help="as generate.store_locking: exclusive waits for no writer, it refuses while one holds the store",
        )
    args = parser.parse_args(argv)
    files = store_files(args.store)
    if not files:
        parser.error(f"{args.store}: no such response store (nor a shard's file beside it)")
    keep = {key for path in args.keep for key in used_keys(path)}
    for path in files:
        with ResponseStore(path, args.locking) as store:
            total = len(store)
            if args.command == "stats":
                used = f", {len(keep & store.keys())} used by {', '.join(args.keep)}" if args.keep else ""
                print(f"{path}: {total} replies{used}")
            else:
                removed = store.prune(keep)
                print(f"{path}: removed {removed} of {total} replies; {total - removed} kept")
    return 0


if __name__ == "__main__":
    sys.exit(main())
