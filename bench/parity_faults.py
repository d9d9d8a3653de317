"""Replay against vLLM on a finished run, with the draft as trained and with injected faults.

    .venv/bin/python bench/parity_faults.py [--workdir .] [--configfile my.yaml] [--faults aux_layer_ids d2t]

Reads a finished run of the config (its parity report, prepared verifier, default draft,
vocab map, eval prompts, baseline and metrics). For each fault it copies the draft, breaks
it as a hand-run export would, serves it in vLLM on the benchmark workload (the config's
server and benchmark sections, the run's baseline) and runs the parity job's replay and
checks on the served streams:

- `aux_layer_ids`: the exported eagle_aux_hidden_state_layer_ids one layer off (+1);
- `d2t`: the exported d2t off by one (draft token i mapped to draft token i + 1's verifier token).

Prints one Markdown row per draft: vLLM's mean acceptance length and per position, the
replay's on the same streams, their gap and the gate's findings. The first row is the run's
own parity report (the draft as trained).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workflow"))  # the eagleflow package

from safetensors.torch import load_file, save_file

from devkit.configs import extraction_section
from devkit.runs import FinishedRun
from eagleflow.benchmark.parity import ParityConfig, extraction_job, run_parity
from eagleflow.benchmark.run import run_benchmark
from eagleflow.benchmark.workload import BenchmarkConfig
from eagleflow.common.config import typed
from eagleflow.runtime.logs import configure_logging
from eagleflow.runtime.spec import ServerConfig, ServerSpec


def break_aux_layer_ids(draft: Path) -> None:
    config = json.loads((draft / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in config["eagle_aux_hidden_state_layer_ids"]]
    (draft / "config.json").write_text(json.dumps(config, indent=2))


def break_d2t(draft: Path) -> None:
    """Off by one: draft token i maps to draft token i + 1's verifier token."""
    weights = load_file(str(draft / "model.safetensors"))
    d2t = weights["d2t"].clone()
    d2t[:-1] = weights["d2t"][1:] + 1
    weights["d2t"] = d2t
    save_file(weights, str(draft / "model.safetensors"), metadata={"format": "pt"})


FAULTS = {"aux_layer_ids": break_aux_layer_ids, "d2t": break_d2t}


def row(name: str, parity: dict) -> str:
    vllm, replay = parity["vllm"], parity["replay"]
    pos = lambda r: " / ".join(f"{x:.3f}" for x in r["per_position_acceptance"])  # noqa: E731
    findings = ", ".join(f["check"] for f in parity["findings"]) or "none"
    return (
        f"| {name} | {vllm['mean_acceptance_length']:.3f} ({pos(vllm)}) | "
        f"{replay['mean_acceptance_length']:.3f} ({pos(replay)}) | {parity['gap']:+.3f} | "
        f"{parity['replay_every_anchor']['mean_acceptance_length']:.3f} | {findings} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("."))
    parser.add_argument("--configfile", nargs="*", default=[])
    parser.add_argument("--faults", nargs="*", default=list(FAULTS), choices=list(FAULTS))
    args = parser.parse_args()
    configure_logging(sys.stderr)
    finished = FinishedRun.of(args.workdir, args.configfile)
    config, run, verifier = finished.config, finished.run, finished.verifier
    server = ServerConfig.from_section(config["server"])
    bench = typed(BenchmarkConfig, config["benchmark"], "benchmark")
    cfg = typed(ParityConfig, config["parity"], "parity")
    hs = extraction_section(config["hidden_states"])
    lines = [
        "| draft | vLLM mean acceptance length (per position) | replay, same streams | vLLM - replay "
        "| replay, every anchor | findings |",
        "| --- | --- | --- | --- | --- | --- |",
        row("as trained (the run's parity job)", json.loads((run / "variants/default/parity/report.json").read_text())),
    ]
    print(lines[-1], flush=True)
    with tempfile.TemporaryDirectory(prefix="parity-faults-") as tmp:
        for fault in args.faults:
            out = Path(tmp) / fault
            draft = out / "draft"
            shutil.copytree(run / "drafts/default/draft", draft)
            FAULTS[fault](draft)
            report, streams = out / "report.json", out / "streams.jsonl"
            run_benchmark(
                str(run / "benchmark_sets.json"),
                verifier,
                str(draft),
                str(report),
                str(out / "benchmark.vllm"),
                server=ServerSpec.from_config(server, verifier),
                cfg=bench,
                chat_template_kwargs=config["generate"]["chat_template_kwargs"],
                baseline=str(run / "baseline/report.json"),
                streams_out=str(streams),
            )
            (out / "logs").mkdir()
            extraction = extraction_job(
                verifier,
                hs,
                config["server"] if hs["backend"] == "vllm" else None,
                config["verifier"]["trust_remote_code"],
                log_path=str(out / "logs/parity.default.log"),
                threads=2,
                gpus=0,
            )
            parity = run_parity(
                extraction,
                draft_dir=str(draft),
                vocab_map=str(run / "vocab/default/vocab_map.safetensors"),
                streams_path=str(streams),
                benchmark_report=str(report),
                metrics_path=str(run / "drafts/default/train/metrics.jsonl"),
                prompts_path=str(run / "prompts/eval.jsonl"),
                train_path=str(run / "dataset/train.parquet"),
                max_model_len=config["server"]["max_model_len"],
                max_seq_len=config["dataset"]["max_seq_len"],
                out=str(out / "parity.json"),
                chat_template_kwargs=config["generate"]["chat_template_kwargs"],
                greedy_data=config["generate"]["temperature"] == 0,
                cfg=cfg,
            )
            lines.append(row(f"{fault} broken", parity))
            print(lines[-1], flush=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
