"""Drafts screened on served greedy streams: each draft's acceptance per set, replayed as the
parity rule replays it, with one extraction of the verifier's states for every draft.

    .venv/bin/python bench/replay_sets.py --workdir DIR --streams KEEP/LABEL.streams.jsonl
        [--configfile my.yaml ...] [--draft default [OTHER_ID | [LABEL=]PATH ...]] [-k 3]

At T = 0 the verifier's reply does not depend on the draft, so the greedy streams one draft's
benchmark served (`bench/standard_sets.py --out KEEP` keeps them, every set's) are what any
other draft would be served. The parity rule's replay reproduces vLLM's acceptance on such
streams (gap 0.005 on the demo, BENCHMARKS.md), so replaying each draft over them ranks drafts
in about a minute each where a vLLM benchmark takes a server and about 10 minutes per draft for
MT-Bench and HumanEval at T = 0 (21 at 0 and 0.7). A screen, not a measurement: figures that
land in BENCHMARKS.md come from vLLM (`bench/standard_sets.py`); this says which drafts are
worth measuring there.

The verifier's states come from the run's hidden-state backend (`hidden_states.backend`, the
server section for vllm), rounded through its storage dtype, as training read them. Prints a
Markdown row per draft and set: the replay's mean acceptance length (the anchors vLLM visits)
and per position.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workflow"))  # the eagleflow package

from bench.standard_sets import draft_dirs
from devkit.configs import extraction_section
from devkit.runs import FinishedRun
from eagleflow.benchmark.parity import extraction_job, replay_streams, stream_samples
from eagleflow.benchmark.speculative import read_draft_config, serving_config
from eagleflow.common.acceptance import context_edges
from eagleflow.common.atomic import read_jsonl
from eagleflow.runtime.logs import configure_logging

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--workdir", type=Path, default=Path("."))
parser.add_argument("--configfile", nargs="*", default=[])
parser.add_argument("--streams", type=Path, required=True, help="greedy streams a benchmark served (one JSON per line)")
parser.add_argument(
    "--draft", nargs="*", default=["default"], help="the run's draft ids or [LABEL=]PATH to draft directories"
)
parser.add_argument(
    "-k", type=int, default=3, help="speculative tokens per step of an EAGLE-3 draft (the others' are their config's)"
)


def main() -> None:
    args = parser.parse_args()
    configure_logging(sys.stderr)
    from eagleflow.train.draft import load_draft
    from eagleflow.train.methods import method_of

    finished = FinishedRun.of(args.workdir, args.configfile)
    config, verifier = finished.config, finished.verifier
    # Streams too short to hold a draft step carry nothing to replay (as in parity).
    streams = [s for s in read_jsonl(args.streams) if len(s["token_ids"]) >= 2]
    drafts = draft_dirs(args.draft, finished.run)
    with tempfile.TemporaryDirectory(prefix="replay-sets-") as tmp:
        extraction = extraction_job(
            verifier,
            extraction_section(config["hidden_states"]),
            config["server"] if config["hidden_states"]["backend"] == "vllm" else None,
            config["verifier"]["trust_remote_code"],
            log_path=str(Path(tmp) / "extraction.log"),
            threads=os.cpu_count() or 1,
            gpus=int(config["hidden_states"]["gpus"]),
        )
        methods = {label: method_of(read_draft_config(d)) for label, d in drafts.items()}
        # The streams as each alignment reads them (shifted for the EAGLE family, as they are
        # for a block drafter), extracted once each.
        samples = {
            shifted: stream_samples(extraction, streams, shifted) for shifted in {m.shifted for m in methods.values()}
        }
    edges = context_edges(int(config["server"]["max_model_len"]))
    print("| draft | set | streams | replayed mean acceptance length | per position |")
    print("| --- | --- | --- | --- | --- |")
    for label, directory in drafts.items():
        draft = load_draft(str(directory), verifier, attn_impl="sdpa").eval()
        method = methods[label]
        if method.propose is None:
            logging.warning("%s: a %s draft's drafting is not replayed; skipped", label, method.name)
            continue
        k = serving_config(read_draft_config(directory), method.served(), args.k)["num_speculative_tokens"]
        replays = replay_streams(method.propose, draft, samples[method.shifted], streams, k, edges)
        for name, replay in sorted(replays.items()):
            summary = replay.visited.summary()
            per_pos = " / ".join(f"{x:.3f}" for x in summary["per_position_acceptance"])
            print(f"| {label} | {name} | {replay.streams} | {summary['mean_acceptance_length']:.3f} | {per_pos} |")
        logging.info("replayed %s", label)


if __name__ == "__main__":
    main()
