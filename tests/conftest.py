"""pytest fixtures; the builders behind them live in tests/helpers.py."""

import os
from pathlib import Path

import pytest

from tests.helpers import REPO, VERIFIER_BUILDERS, save_tiny_llama


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
