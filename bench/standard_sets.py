"""A finished run's draft on the standard sets, at each temperature, without touching the run.

    .venv/bin/python bench/standard_sets.py --workdir DIR [--configfile my.yaml ...]
        [--sets mt_bench:80 humaneval:164] [--temperatures 0 0.7] [--draft default] [--out FILE]

Reads a finished run of the config in DIR (its prepared verifier, eval prompts and a draft)
and measures what the benchmark rules measure, with this checkout's code: the sets built as
the benchmark_sets rule builds them (`name:size`, size `all` for the whole set), the verifier
alone and then with the draft, one server each, every set at every temperature. Prints a
Markdown row per set and temperature (mean acceptance length, per position, speedup) and,
with --out, writes the benchmark's report.json there. Nothing under DIR is written: for runs
made by an older checkout, whose outputs the config-file way (config/examples/
standard-sets.yaml) would rebuild.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workflow_scripts.benchmark.run import BenchmarkConfig, Workload, run_baseline, run_benchmark
from workflow_scripts.benchmark.set_job import conversation_tokens
from workflow_scripts.benchmark.sets import SetSpec, build_sets
from workflow_scripts.common.atomic import read_jsonl, write_json
from workflow_scripts.common.config import typed
from workflow_scripts.plan import load_merged_config
from workflow_scripts.runtime.spec import ServerConfig, ServerSpec


def set_spec(arg: str) -> SetSpec:
    name, _, size = arg.partition(":")
    return SetSpec.of({"name": name, "size": None if size in ("", "all") else int(size)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("."))
    parser.add_argument("--configfile", nargs="*", default=[])
    parser.add_argument("--sets", nargs="*", default=["mt_bench:all", "humaneval:all"])
    parser.add_argument("--temperatures", nargs="*", type=float, default=[0.0, 0.7])
    parser.add_argument("--draft", default="default", help="drafts/<id> of the run")
    parser.add_argument("--out", help="write the benchmark's report.json here too")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    workdir = args.workdir.resolve()
    config = load_merged_config(args.configfile, workdir)
    bench = config["benchmark"] | {"sets": [], "temperatures": args.temperatures}
    cfg = typed(BenchmarkConfig, bench, "benchmark")
    run = workdir / "results" / config["run"]
    verifier = str(workdir / "resources/verifier" / config["verifier"]["name"])
    kwargs = config["generate"]["chat_template_kwargs"]
    sets = build_sets(
        read_jsonl(run / "prompts/eval.jsonl"),
        cfg.num_prompts,
        [set_spec(a) for a in args.sets],
        conversation_tokens(verifier, kwargs),
        cfg.max_tokens,
        config["server"]["max_model_len"],
    )
    server = ServerSpec.from_config(ServerConfig.from_section(config["server"]), verifier)
    with tempfile.TemporaryDirectory(prefix="standard-sets-") as tmp:
        out = Path(tmp)
        write_json(out / "sets.json", {"sets": sets})
        workload = Workload.of(cfg, kwargs)
        run_baseline(
            str(out / "sets.json"),
            verifier,
            str(out / "baseline.json"),
            str(out / "b"),
            server=server,
            workload=workload,
        )
        run_benchmark(
            str(out / "sets.json"),
            verifier,
            str(run / "drafts" / args.draft / "draft"),
            str(out / "report.json"),
            str(out / "s"),
            server=server,
            cfg=cfg,
            chat_template_kwargs=kwargs,
            baseline=str(out / "baseline.json"),
            streams_out=str(out / "streams.jsonl"),
        )
        report = json.loads((out / "report.json").read_text())
    if args.out:
        write_json(args.out, report)
    print("| set | temperature (seed) | requests | mean acceptance length | per position | speedup |")
    print("| --- | --- | --- | --- | --- | --- |")
    for cell in report["cells"].values():
        spec = cell["speculative"]
        seed = "" if cell["seed"] is None else f" (seed {cell['seed']})"
        per_pos = " / ".join(f"{x:.3f}" for x in spec["per_position_acceptance"])
        print(
            f"| {cell['set']} | {cell['temperature']:g}{seed} | {cell['requests']} | "
            f"{spec['mean_acceptance_length']:.3f} | {per_pos} | {cell['speedup']:.2f}x |"
        )


if __name__ == "__main__":
    main()
