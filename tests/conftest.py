"""pytest fixtures; the builders behind them live in tests/helpers.py."""

import os
from pathlib import Path

import pytest

from tests.helpers import REPO, VERIFIER_BUILDERS, save_tiny_llama

# The modules whose tests share the finished run (a session fixture; test_pipeline edits
# files inside it): under pytest-xdist they must all run on one worker.
SHARED_RUN_MODULES = frozenset({"test_pipeline.py", "test_parity.py", "test_slurm.py", "test_vllm_extraction.py"})


def xdist_scope(nodeid: str) -> str:
    """The unit of work a test goes to a worker with (`make test` runs two): the shared run's
    modules together, each other integration module whole (module fixtures: a server, a
    run), unit tests one by one."""
    module = nodeid.split("::", 1)[0]
    if module.rsplit("/", 1)[-1] in SHARED_RUN_MODULES:
        return "finished_run"
    return module if "/integration/" in module else nodeid


def pytest_xdist_make_scheduler(config, log):
    """Scope scheduling with xdist_scope (xdist's own `loadgroup` marks are not applied
    under pytest 9: the group suffix it writes into node ids does not stick)."""
    from xdist.scheduler import LoadScopeScheduling

    class Scheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_scope(nodeid)

    return Scheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """Every test of the shared run is in SHARED_RUN_MODULES (or xdist would run the run
    again on the other worker, and a test there would read a run another worker edits), and
    workers take work in collection order: the shared run's group first, so the rest fills
    the other worker meanwhile; unit tests last."""
    stray = [i.nodeid for i in items if "finished_run" in i.fixturenames and xdist_scope(i.nodeid) != "finished_run"]
    if stray:
        raise pytest.UsageError(f"tests use finished_run outside tests/conftest.py's SHARED_RUN_MODULES: {stray}")
    items.sort(key=lambda i: 0 if xdist_scope(i.nodeid) == "finished_run" else 2 if "unit" in i.path.parts else 1)


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_think_dir(tmp_path_factory) -> Path:
    """Like tiny_llama_dir, with <think>/</think> single tokens and a thinking chat template."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-think"), think=True)


@pytest.fixture
def clean_env():
    return {k: v for k, v in os.environ.items() if not k.startswith("SNAKEMAKE")}


@pytest.fixture(scope="session", params=sorted(VERIFIER_BUILDERS))
def tiny_verifier(request, tmp_path_factory) -> tuple[str, Path]:
    """(family, model dir) for each tiny verifier family; kimi_k2 needs trust_remote_code."""
    return request.param, VERIFIER_BUILDERS[request.param](tmp_path_factory.mktemp(f"tiny-{request.param}"))
