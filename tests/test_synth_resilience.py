"""synth against a fault-injecting local server: retries, errors file, kill-and-resume,
and the resume cache's fingerprint."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx2
import pyarrow.parquet as pq

from tests.conftest import REPO, fake_openai
from workflow_scripts.common.atomic import write_jsonl
from workflow_scripts.synth.generate import run_synth

CFG = {
    "served_model_name": "verifier",
    "sampling": {"max_tokens": 12, "temperature": 0.0},
    "expect_reasoning": False,
    "concurrency": 8,
    "request_timeout_s": 1.0,
    "max_attempts": 8,
    "api_key_env": None,
    "verifier": {"name": "fake"},
}


def write_prompts(path: Path, n: int, poison: int | None = None) -> list[dict]:
    prompts = []
    for i in range(n):
        turns = [f"question {i}"] + ([f"follow-up {i}"] if i % 5 == 0 else [])
        if i == poison:
            turns = [f"POISON {i}"]
        prompts.append({"id": f"p{i:03d}", "category": "t", "system": None, "turns": turns})
    write_jsonl(path, prompts)
    return prompts


def outputs(d: Path) -> dict[str, Path]:
    return {"responses": d / "responses.parquet", "errors": d / "errors.jsonl", "quality": d / "quality.json", "cache": d / "cache"}


def synth(prompts: Path, url, d: Path, cfg=CFG) -> dict[str, Path]:
    o = outputs(d)
    run_synth(str(prompts), url, str(o["cache"]), str(o["responses"]), str(o["errors"]), str(o["quality"]), cfg)
    return o


def test_faults_end_with_every_sample_done_or_in_errors_and_none_twice(tmp_path):
    prompts = write_prompts(tmp_path / "prompts.jsonl", 60, poison=7)
    with fake_openai("--fault-rate", "0.3", "--hang", "3", "--seed", "1", "--lifetime", "240") as url:
        o = synth(tmp_path / "prompts.jsonl", url, tmp_path / "run")
    rows = pq.read_table(o["responses"]).to_pylist()
    errors = [json.loads(line) for line in o["errors"].read_text().splitlines()]
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), "a sample was written twice"
    done = {r["prompt_id"] for r in rows if r["turn"] == 0}
    failed = {e["conversation_id"] for e in errors}
    assert done | failed == {p["id"] for p in prompts}
    assert "p007" in failed
    poison = next(e for e in errors if e["conversation_id"] == "p007")
    assert "HTTP 500" in poison["reason"] and poison["attempts"] == CFG["max_attempts"]
    # With 30% faults and 8 attempts, everything but the poisoned prompt gets through.
    assert failed == {"p007"}
    for p in prompts:
        if p["id"] != "p007":
            assert sum(r["prompt_id"] == p["id"] for r in rows) == len(p["turns"])
    quality = json.loads(o["quality"].read_text())
    assert quality["request_errors"] == 1 and quality["num_samples"] == len(rows)


def test_a_rerun_retries_failed_conversations_and_keeps_finished_ones(tmp_path):
    write_prompts(tmp_path / "prompts.jsonl", 12)
    with fake_openai("--fault-rate", "1.0", "--hang", "3", "--lifetime", "60") as down:
        cfg = {**CFG, "max_attempts": 1}
        o = synth(tmp_path / "prompts.jsonl", down, tmp_path / "run", cfg)
    assert len(o["errors"].read_text().splitlines()) == 12
    with fake_openai("--lifetime", "60") as up:
        o = synth(tmp_path / "prompts.jsonl", up, tmp_path / "run")
    assert o["errors"].read_text() == ""
    assert len(pq.read_table(o["responses"])) == 12 + 3  # prompts 0, 5, 10 have two turns


def test_several_endpoints_share_the_load(tmp_path):
    write_prompts(tmp_path / "prompts.jsonl", 40)
    with fake_openai("--latency", "0.05", "--lifetime", "120") as a, fake_openai("--latency", "0.05", "--lifetime", "120") as b:
        o = synth(tmp_path / "prompts.jsonl", [a, b], tmp_path / "run")
        served = [float(httpx2.get(f"{u}/metrics").text.split()[-1]) for u in (a, b)]
    assert len(pq.read_table(o["responses"])) == 48
    assert min(served) >= 0.3 * sum(served), f"load was not shared: {served}"


SYNTH_JOB = textwrap.dedent(
    """
    import json, logging, sys
    from workflow_scripts.common.server import terminate_on_sigterm
    from workflow_scripts.synth.generate import run_synth
    logging.basicConfig(level=logging.INFO)
    terminate_on_sigterm()  # as every Snakemake entry point does
    prompts, url, out, cfg = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    run_synth(prompts, url, out + "/cache", out + "/responses.parquet", out + "/errors.jsonl", out + "/quality.json", cfg)
    """
)


def synth_job(prompts: Path, url: str, d: Path, env=None) -> subprocess.Popen:
    d.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([sys.executable, "-c", SYNTH_JOB, str(prompts), url, str(d), json.dumps(CFG)], cwd=d, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip


def cached_lines(d: Path) -> int:
    return sum(len(p.read_bytes().splitlines()) for p in (d / "cache").glob("*.jsonl")) if (d / "cache").exists() else 0


def interrupt(job: subprocess.Popen, out: Path, after: int, sig: int) -> float:
    """Send `sig` once `after` conversations are cached; return seconds until the job ended."""
    deadline = time.monotonic() + 60
    while cached_lines(out) < after and time.monotonic() < deadline:
        time.sleep(0.05)
    job.send_signal(sig)
    sent = time.monotonic()
    job.wait(timeout=30)
    return time.monotonic() - sent


def table(path: Path) -> list[dict]:
    return sorted(pq.read_table(path).to_pylist(), key=lambda r: r["id"])


def test_sigkill_then_rerun_gives_the_same_set_as_an_uninterrupted_run(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    write_prompts(prompts, 80)
    with fake_openai("--latency", "0.1", "--lifetime", "300") as url:
        full = tmp_path / "full"
        assert synth_job(prompts, url, full).wait(timeout=120) == 0

        killed = tmp_path / "killed"
        interrupt(synth_job(prompts, url, killed), killed, 20, signal.SIGKILL)
        partial = cached_lines(killed)
        assert 20 <= partial < 80, f"kill landed at {partial} of 80 conversations"
        assert not (killed / "responses.parquet").exists()

        rerun = synth_job(prompts, url, killed)
        _, err = rerun.communicate(timeout=120)
        assert rerun.returncode == 0, err
    assert f"resuming: {partial} conversations" in err
    assert cached_lines(killed) == 80, "the rerun generated a finished conversation again"
    assert table(killed / "responses.parquet") == table(full / "responses.parquet")


def test_sigterm_stops_promptly_and_loses_nothing(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    write_prompts(prompts, 80)
    with fake_openai("--latency", "0.1", "--lifetime", "300") as url:
        out = tmp_path / "run"
        job = synth_job(prompts, url, out)
        assert interrupt(job, out, 10, signal.SIGTERM) < 10
        assert job.returncode != 0
        lines = [json.loads(line) for p in (out / "cache").glob("*.jsonl") for line in p.read_text().splitlines()]
        assert len({r["conversation_id"] for r in lines}) == len(lines) >= 10
        rerun = synth_job(prompts, url, out)
        _, err = rerun.communicate(timeout=120)
    assert rerun.returncode == 0, err
    assert f"resuming: {len(lines)} conversations" in err
    assert len(pq.read_table(out / "responses.parquet")) == 96


def test_a_changed_generator_discards_the_cache(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    write_prompts(prompts, 10)
    copy = tmp_path / "code"
    shutil.copytree(REPO / "workflow_scripts", copy / "workflow_scripts", ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "PYTHONPATH": str(copy)}
    with fake_openai("--lifetime", "120") as url:
        out = tmp_path / "run"
        assert synth_job(prompts, url, out, env).wait(timeout=120) == 0
        before = list((out / "cache").glob("*.jsonl"))
        # A behaviour change in the generator: history no longer carries earlier reasoning.
        gen = copy / "workflow_scripts/synth/generate.py"
        source = gen.read_text()
        assert 'reply["reasoning_content"] = c.reasoning' in source
        gen.write_text(source.replace('reply["reasoning_content"] = c.reasoning', "pass"))
        job = synth_job(prompts, url, out, env)
        _, err = job.communicate(timeout=120)
        assert job.returncode == 0, err
        # A comment-only edit keeps the cache.
        gen.write_text("# a comment\n" + gen.read_text())
        again = synth_job(prompts, url, out, env)
        _, err_again = again.communicate(timeout=120)
    assert "discarding synth cache" in err and before[0].name in err
    after = list((out / "cache").glob("*.jsonl"))
    assert len(after) == 1 and after != before
    assert "discarding" not in err_again and "resuming: 10 conversations" in err_again
