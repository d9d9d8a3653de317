"""A finished run's drafts on the standard sets, at each temperature, without touching the run.

    .venv/bin/python bench/standard_sets.py --workdir DIR [--configfile my.yaml ...]
        [--sets mt_bench:80 humaneval:164] [--temperatures 0 0.7]
        [--draft default [OTHER_ID | [LABEL=]PATH ...]] [--out KEEP_DIR]

Reads a finished run of the config in DIR (its prepared verifier, eval prompts and drafts)
and measures what the benchmark rules measure, with this checkout's code: the sets built as
the benchmark_sets rule builds them (`name:size`, size `all` for the whole set), the verifier
alone once, then each draft, one server each, every set at every temperature. A draft is one
of the run's (`drafts/<id>`) or any draft directory, another run's too (a draft trained on
other data, measured against the same baseline). Prints a Markdown row per draft, set and
temperature (mean acceptance length, per position, speedup). With --out, the sets, the
baseline and each draft's report.json (`<label>.json`) are kept there, and a later call with
the same sets, server and workload measures only the drafts it has not measured against that
baseline (a draft's files by digest): a long call that was stopped goes on where it stopped,
and one draft at a time can be added. Nothing under DIR is written: for
runs made by an older checkout, whose outputs the config-file way (config/examples/
standard-sets.yaml) would rebuild.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workflow"))  # the eagleflow package

from devkit.runs import FinishedRun
from eagleflow.benchmark.baseline import run_baseline
from eagleflow.benchmark.run import run_benchmark
from eagleflow.benchmark.sets import SetSpec, build_sets
from eagleflow.benchmark.sized_sets import conversation_tokens
from eagleflow.benchmark.speculative import read_draft_config
from eagleflow.benchmark.workload import BenchmarkConfig, Workload
from eagleflow.common.atomic import read_jsonl, write_json
from eagleflow.common.config import typed
from eagleflow.common.identity import content_digest, verifier_fingerprint
from eagleflow.runtime.logs import configure_logging
from eagleflow.runtime.spec import ServerConfig, ServerSpec
from eagleflow.train.methods import method_of


def set_spec(arg: str) -> SetSpec:
    name, _, size = arg.partition(":")
    return SetSpec.of({"name": name, "size": None if size in ("", "all") else int(size)})


def draft_dirs(args: list[str], run: Path) -> dict[str, Path]:
    """{label: draft directory}: `ID` is the run's drafts/ID/draft, `LABEL=PATH` (or a PATH,
    labelled by its parents) a draft directory anywhere, another run's included."""
    out = {}
    for arg in args:
        label, sep, path = arg.partition("=")
        if sep:
            directory = Path(path)
        elif "/" in arg:
            directory = Path(arg)
            label = "/".join(directory.resolve().parts[-4:-1:2])  # results/<run>/drafts/<id>/draft -> <run>/<id>
        else:
            directory = run / "drafts" / arg / "draft"
        if not (directory / "config.json").is_file():
            raise SystemExit(f"--draft {arg}: {directory} is not a draft directory (no config.json); train it first")
        if label in out:
            raise SystemExit(f"--draft: two drafts are labelled {label!r}; name one LABEL=PATH")
        out[label] = directory.resolve()
    return out


def already_measured(result: Path, key_file: Path, key: dict[str, Any]) -> bool:
    """`result` is kept and was measured under `key` (compared as written: JSON)."""
    return result.is_file() and key_file.is_file() and json.loads(key_file.read_text()) == json.loads(json.dumps(key))


def measure_drafts(
    sets: list[dict[str, Any]],
    verifier: str,
    server: ServerSpec,
    cfg: BenchmarkConfig,
    chat_template_kwargs: dict[str, Any],
    drafts: dict[str, Path],
    out: Path,
) -> dict[str, dict[str, Any]]:
    """The verifier alone on `sets` once, then each draft against it, as the benchmark rules
    measure them: {label: the draft's report.json}. The sets, the baseline and each report
    (`<label>.json`, a `/` as `-`) are written under `out`; a baseline `out` already holds for
    the same sets, server and workload is used again, and so is a report of the same draft
    files against that baseline (`<label>.key.json`)."""
    workload = Workload.of(cfg, chat_template_kwargs)
    measured = {"sets": sets, "workload": dataclasses.asdict(workload), "server": server.command(0)}
    baseline, kept = out / "baseline.json", out / "measured.json"
    if already_measured(baseline, kept, measured):
        logging.info("the verifier alone: %s measured these sets with this server and workload", baseline)
    else:
        write_json(out / "sets.json", {"sets": sets})
        run_baseline(str(out / "sets.json"), verifier, str(baseline), str(out / "b"), server=server, workload=workload)
        write_json(kept, measured)
    reports = {}
    for label, directory in drafts.items():
        name = label.replace("/", "-")
        report, key_file = out / f"{name}.json", out / f"{name}.key.json"
        key = {
            "measured": measured,
            "baseline": content_digest(baseline),
            "draft": verifier_fingerprint(directory, progress=False),
        }
        if already_measured(report, key_file, key):
            logging.info("%s: %s measured this draft against this baseline", label, report)
        else:
            run_benchmark(
                str(out / "sets.json"),
                verifier,
                str(directory),
                str(report),
                str(out / name),
                server=server,
                cfg=cfg,
                serving=method_of(read_draft_config(str(directory))).served(),
                chat_template_kwargs=chat_template_kwargs,
                baseline=str(baseline),
                streams_out=str(out / f"{name}.streams.jsonl"),
            )
            write_json(key_file, key)
        reports[label] = json.loads(report.read_text())
    return reports


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("."))
    parser.add_argument("--configfile", nargs="*", default=[])
    parser.add_argument("--sets", nargs="*", default=["mt_bench:all", "humaneval:all"])
    parser.add_argument("--temperatures", nargs="*", type=float, default=[0.0, 0.7])
    parser.add_argument(
        "--draft", nargs="+", default=["default"], help="drafts/<id> of the run, or [LABEL=]PATH of a draft directory"
    )
    parser.add_argument("--out", type=Path, help="keep sets, baseline and each draft's report.json in this directory")
    args = parser.parse_args()
    configure_logging(sys.stderr)
    finished = FinishedRun.of(args.workdir, args.configfile)
    config, run, verifier = finished.config, finished.run, finished.verifier
    bench = config["benchmark"] | {"sets": [], "temperatures": args.temperatures}
    cfg = typed(BenchmarkConfig, bench, "benchmark")
    drafts = draft_dirs(args.draft, run)
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
        out = args.out.resolve() if args.out else Path(tmp)
        reports = measure_drafts(sets, verifier, server, cfg, kwargs, drafts, out)
    print("| draft | set | temperature (seed) | requests | mean acceptance length | per position | speedup |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for label, report in reports.items():
        for cell in report["cells"].values():
            spec = cell["speculative"]
            seed = "" if cell["seed"] is None else f" (seed {cell['seed']})"
            per_pos = " / ".join(f"{x:.3f}" for x in spec["per_position_acceptance"])
            print(
                f"| {label} | {cell['set']} | {cell['temperature']:g}{seed} | {cell['requests']} | "
                f"{spec['mean_acceptance_length']:.3f} | {per_pos} | {cell['speedup']:.2f}x |"
            )


if __name__ == "__main__":
    main()
