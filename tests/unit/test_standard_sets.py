"""bench/standard_sets.py's kept folder: a later call measures only what the folder lacks."""

import json
from pathlib import Path

import pytest

from bench import standard_sets
from eagleflow.benchmark.workload import BenchmarkConfig
from eagleflow.common.atomic import write_json


class Server:
    def command(self, port: int) -> list[str]:
        return ["vllm", "serve", "verifier", "--port", str(port)]


CFG = BenchmarkConfig(3, 4, [], 16, 2, [0.0, 0.7], 0, 60.0, False)
SETS = [{"name": "mt_bench", "prompts": [{"id": "q1"}]}]


@pytest.fixture
def measured(monkeypatch):
    """The labels each call measured (`baseline` for the verifier alone); each measurement
    writes what the real one writes."""
    calls = []

    def run_baseline(sets, verifier, out, logs, server, workload):
        calls.append("baseline")
        write_json(out, {"tokens_per_s": 1.0})

    def run_benchmark(sets, verifier, draft, out, logs, **kwargs):
        calls.append(Path(draft).name)
        write_json(out, {"draft": draft, "cells": {}})

    monkeypatch.setattr(standard_sets, "run_baseline", run_baseline)
    monkeypatch.setattr(standard_sets, "run_benchmark", run_benchmark)
    return calls


def draft(root: Path, name: str, weights: bytes) -> Path:
    d = root / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"name": name, "speculators_model_type": "eagle3"}))
    (d / "model.safetensors").write_bytes(weights)
    return d


def measure(out: Path, drafts: dict[str, Path], sets=SETS) -> dict:
    return standard_sets.measure_drafts(sets, "verifier", Server(), CFG, {}, drafts, out)


def test_a_stopped_call_goes_on_with_the_drafts_it_had_not_measured(tmp_path, measured):
    a, b = draft(tmp_path, "a", b"A"), draft(tmp_path, "b", b"B")
    out = tmp_path / "keep"
    measure(out, {"a": a})
    assert measured == ["baseline", "a"]
    reports = measure(out, {"a": a, "b": b})
    assert measured == ["baseline", "a", "b"]
    assert reports["a"]["draft"] == str(a)  # read back from the folder


def test_a_changed_draft_or_other_sets_are_measured_again(tmp_path, measured):
    a = draft(tmp_path, "a", b"A")
    out = tmp_path / "keep"
    measure(out, {"a": a})
    (a / "model.safetensors").write_bytes(b"retrained")
    measure(out, {"a": a})
    assert measured == ["baseline", "a", "a"]
    measure(out, {"a": a}, sets=[{"name": "humaneval", "prompts": [{"id": "h1"}]}])
    assert measured == ["baseline", "a", "a", "baseline", "a"]
