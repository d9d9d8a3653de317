"""pytest fixtures; the builders behind them live in tests/helpers.py."""

import os
from pathlib import Path

import pytest

from tests.helpers import REPO, VERIFIER_BUILDERS, save_tiny_llama


def pytest_collection_modifyitems(config, items):
    """Keep what a fixture shares on one worker under pytest-xdist (`make test` runs two,
    `--dist loadgroup`): every test of the shared finished run (a session fixture, and some
    tests edit files inside it) goes to one worker, each other integration module (module
    fixtures: a server, a run) as a whole to one; unit tests spread freely."""
    for item in items:
        if "finished_run" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("finished_run"))
        elif item.path.parent.name == "integration":
            item.add_marker(pytest.mark.xdist_group(item.path.stem))


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
