"""What byte-compiling the environment saves each process (`make setup` runs compileall).

    python bench/bytecode.py [--trials N] [--out FILE]

With PYTHONDONTWRITEBYTECODE set (as on the machines this project runs its CI on) no import
writes a .pyc, so without a compiled environment every Python process compiles each module it
imports from source, every time. Each trial runs the imports of a few processes the pipeline
starts again and again, once reading the environment's .pyc files and once without them
(PYTHONPYCACHEPREFIX at an empty directory: Python looks for .pyc files there only, and
writes none), alternating, one after the other on one machine. Reported per process: the
median wall time of each and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

# What the pipeline starts most: vLLM's API server (its engine core imports about the same),
# a stage job (torch, transformers), and Snakemake (every `snakemake` call, every job of a
# cluster run).
PROCESSES = {
    "vllm api server imports": "import vllm.entrypoints.openai.api_server",
    "stage job imports (torch, transformers)": "import torch, transformers, transformers.models.llama.modeling_llama",
    "snakemake imports": "import snakemake.cli",
}


def timed(code: str, env: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--out", help="write the results as JSON here too")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as empty:
        compiled = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
        source = {**compiled, "PYTHONPYCACHEPREFIX": empty}
        for name, code in PROCESSES.items():
            timed(code, compiled)  # the page cache warm for both
            runs = {"compiled": [], "source": []}
            for _ in range(args.trials):
                runs["compiled"].append(timed(code, compiled))
                runs["source"].append(timed(code, source))
            med = {k: statistics.median(v) for k, v in runs.items()}
            ratio = round(med["source"] / med["compiled"], 2)
            results[name] = {**{f"{k}_s": round(v, 2) for k, v in med.items()}, "ratio": ratio}
            print(f"{name}: from source {med['source']:.1f} s, compiled {med['compiled']:.1f} s, ratio {ratio}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
