"""Three drafts, one per prompt source, with the same number of training conversations and
the same training settings, measured by vLLM on the same held-out sets.

    .venv/bin/python bench/prompt_sources.py --workdir DIR [--max-train 200] [--written 360]
        [--sets mt_bench:24 humaneval:24] [--eval 24] [--configfile extra.yaml ...]

The runs, one after another in DIR (a copy of this checkout's workflow; one prepared
verifier, one response store):
- `ps-file`: the demo's prompt file (config/prompts/demo.jsonl);
- `ps-written`: `--written` conversations the verifier writes itself (prompts.written);
- `ps-both`: both, weights 1:1 (its replies all come from the store of the two before).
Each is built up to its draft (`snakemake results/<run>/drafts/default/draft`), capped at
`--max-train` training conversations. Then the verifier alone is measured once, and each draft
on the same sets: MT-Bench and HumanEval slices, `--eval` prompts of the file run's held-out
split and as many of the written run's (held out from all three: the split is a hash of a
conversation's text). Prints a Markdown table, mean acceptance length per set and draft.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "workflow"))  # the eagleflow package, installed or not

from bench.standard_sets import measure_drafts, set_spec  # noqa: E402
from eagleflow.benchmark.sets import SetSpec, build_sets  # noqa: E402
from eagleflow.benchmark.sized_sets import conversation_tokens  # noqa: E402
from eagleflow.benchmark.workload import BenchmarkConfig  # noqa: E402
from eagleflow.common.atomic import read_jsonl, write_json  # noqa: E402
from eagleflow.common.config import typed  # noqa: E402
from eagleflow.dag.plan.needs import load_merged_config  # noqa: E402
from eagleflow.runtime.logs import configure_logging  # noqa: E402
from eagleflow.runtime.spec import ServerConfig, ServerSpec  # noqa: E402

WORKFLOW = ("workflow", "config", "profiles")
RUNS = ("ps-file", "ps-written", "ps-both")


def run_config(run: str, args, store: Path) -> dict:
    """The overrides of run `run`: its sources, the cap, a shared store, no benchmark in the DAG."""
    written = {"count": args.written} if run != "ps-file" else {"count": 0}
    return {
        "run": run,
        "prompts": {
            "source": None if run == "ps-written" else "config/prompts/demo.jsonl",
            "max_train": args.max_train,
            "written": written,
            "weights": {"file": 1.0, "written": 1.0},
        },
        "generate": {"store": str(store)},
        # The same extraction for all three: the comparison is of the prompts.
        "hidden_states": {"backend": "hf"},
    }


def build_draft(workdir: Path, run: str, configs: list[str]) -> float:
    started = time.monotonic()
    cmd = [sys.executable, "-m", "snakemake", f"results/{run}/drafts/default/draft", "--cores", "all", *configs]
    logging.info("%s: %s", run, " ".join(cmd[2:]))
    subprocess.run(cmd, cwd=workdir, check=True)
    return time.monotonic() - started


def samples(workdir: Path, run: str) -> dict:
    r = workdir / "results" / run
    sources = json.loads((r / "prompts/stats.json").read_text())["sources"]
    train = read_jsonl(r / "prompts/train.jsonl")
    quality = json.loads((r / "synth/quality.json").read_text())
    return {
        "train_conversations": len(train),
        "by_source": {s: v["train"] for s, v in sources.items()},
        "samples": quality["num_samples"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--configfile", nargs="*", default=[])
    parser.add_argument("--max-train", type=int, default=200)
    parser.add_argument("--written", type=int, default=360, help="conversations the verifier writes")
    parser.add_argument("--sets", nargs="*", default=["mt_bench:24", "humaneval:24"])
    parser.add_argument("--eval", type=int, default=24, help="prompts of each held-out split measured")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here too")
    args = parser.parse_args()
    configure_logging(sys.stderr)
    workdir = args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    for name in WORKFLOW:
        target = workdir / name
        if target.is_dir():
            shutil.rmtree(target)
        (shutil.copytree if (REPO / name).is_dir() else shutil.copy2)(REPO / name, target)
    store = workdir / "store.sqlite"
    walls, counts = {}, {}
    for run in RUNS:
        cfg = workdir / f"{run}.yaml"
        cfg.write_text(yaml.safe_dump(run_config(run, args, store)))
        configs = ["--configfile", *args.configfile, str(cfg)]
        walls[run] = build_draft(workdir, run, configs)
        counts[run] = samples(workdir, run)
        logging.info("%s: draft in %.0f s; %s", run, walls[run], counts[run])

    config = load_merged_config([*args.configfile, str(workdir / "ps-file.yaml")], workdir)
    bench = config["benchmark"] | {"sets": [], "temperatures": [0.0], "num_prompts": args.eval}
    cfg = typed(BenchmarkConfig, bench, "benchmark")
    verifier = str(workdir / "resources/verifier" / config["verifier"]["name"])
    kwargs = config["generate"]["chat_template_kwargs"]
    written_eval = workdir / "results/ps-written/prompts/eval.jsonl"
    specs = [set_spec(a) for a in args.sets]
    specs.append(SetSpec.of({"name": "written_eval", "path": str(written_eval), "size": args.eval}))
    sets = build_sets(
        read_jsonl(workdir / "results/ps-file/prompts/eval.jsonl"),
        cfg.num_prompts,
        specs,
        conversation_tokens(verifier, kwargs),
        cfg.max_tokens,
        config["server"]["max_model_len"],
    )
    server = ServerSpec.from_config(ServerConfig.from_section(config["server"]), verifier)
    drafts = {run: workdir / "results" / run / "drafts/default/draft" for run in RUNS}
    with tempfile.TemporaryDirectory(prefix="prompt-sources-") as tmp:
        reports = measure_drafts(sets, verifier, server, cfg, kwargs, drafts, Path(tmp))
    names = {"eval": "eval (demo file's held-out split)", "written_eval": "written_eval (the verifier's held-out)"}
    print("| set (requests) | " + " | ".join(RUNS) + " |")
    print("| --- | " + " | ".join("---" for _ in RUNS) + " |")
    for key, cell in reports[RUNS[0]]["cells"].items():
        als = [reports[r]["cells"][key]["speculative"]["mean_acceptance_length"] for r in RUNS]
        print(f"| {names.get(cell['set'], cell['set'])} ({cell['requests']}) | " + " | ".join(f"{a:.3f}" for a in als))
    print(
        "| training conversations (file / written) | "
        + " | ".join(
            f"{counts[r]['train_conversations']} ({counts[r]['by_source'].get('file', 0)} / "
            f"{counts[r]['by_source'].get('written', 0)})"
            for r in RUNS
        )
        + " |"
    )
    print("| training samples (assistant turns) | " + " | ".join(str(counts[r]["samples"]) for r in RUNS) + " |")
    print("| wall time to the draft | " + " | ".join(f"{walls[r]:.0f} s" for r in RUNS) + " |")
    if args.out:
        write_json(args.out, {"counts": counts, "walls": walls, "cells": {r: reports[r]["cells"] for r in RUNS}})


if __name__ == "__main__":
    main()
