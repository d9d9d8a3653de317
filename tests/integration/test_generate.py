"""generate against a fault-injecting local server: retries, the errors it hands to synth,
kill-and-resume through the response store, and what the store is keyed by."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx2
import pytest

from devkit.configs import server_config
from devkit.fake_openai import fake_openai_server as fake_openai
from eagleflow.common.atomic import write_jsonl
from eagleflow.common.replies import read_replies
from eagleflow.generate.join import join_shards
from eagleflow.generate.run import Client, Requests, run_generate
from eagleflow.runtime.client import RetryPolicy
from eagleflow.runtime.response_store import ResponseStore, StoreError
from eagleflow.runtime.spec import ServerError
from eagleflow.runtime.vllm_server import free_port
from tests.helpers import REPO, stored_replies

REQUESTS = Requests(model="verifier", sampling={"max_tokens": 12, "temperature": 0.0}, chat_template_kwargs={})
CLIENT = Client(
    concurrency=8, adaptive=True, request_timeout_s=1.0, max_attempts=8, api_key_env=None, store_locking="auto"
)


def write_prompts(path: Path, n: int, poison: int | None = None) -> list[dict]:
    prompts = []
    for i in range(n):
        turns = [f"question {i}"] + ([f"follow-up {i}"] if i % 5 == 0 else [])
        if i == poison:
            turns = [f"POISON {i}"]
        prompts.append({"id": f"p{i:03d}", "category": "t", "system": None, "turns": turns})
    write_jsonl(path, prompts)
    return prompts


@pytest.fixture(scope="module")
def verifier(tmp_path_factory) -> Path:
    """Generate fingerprints the verifier's files; the fake server ignores them."""
    d = tmp_path_factory.mktemp("verifier")
    (d / "config.json").write_text(json.dumps({"model_type": "fake"}))
    return d


def generate(prompts: Path, url, d: Path, verifier: Path, requests=REQUESTS, client=CLIENT, **server) -> dict:
    d.mkdir(parents=True, exist_ok=True)
    run_generate(
        str(prompts),
        str(verifier),
        str(d / "store.sqlite"),
        str(d / "replies.parquet"),
        str(d / "stats.json"),
        requests=requests,
        client=client,
        server=server_config(endpoint=url, **server),
        server_log=str(d / "vllm.log"),
    )
    return json.loads((d / "stats.json").read_text())


def served(url: str) -> int:
    return int(float(httpx2.get(f"{url}/metrics").text.split()[-1]))


def test_faults_end_with_every_turn_replied_or_in_errors_and_none_twice(tmp_path, verifier, monkeypatch):
    # What is checked is where every turn ends up, not how long the client waits between tries.
    monkeypatch.setattr(RetryPolicy, "delay", lambda self, attempt: 0.02)
    prompts = write_prompts(tmp_path / "prompts.jsonl", 60, poison=7)
    with fake_openai("--fault-rate", "0.3", "--hang", "3", "--seed", "1", "--lifetime", "240") as url:
        stats = generate(tmp_path / "prompts.jsonl", url, tmp_path / "run", verifier)
    rows = read_replies(tmp_path / "run/replies.parquet")
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), "a turn was written twice"
    failed = {r["prompt_id"] for r in rows if r["error"]}
    assert failed == {"p007"}  # with 30% faults and 8 attempts, only the poisoned prompt fails
    poison = next(r for r in rows if r["error"])
    assert "HTTP 500" in poison["error"] and poison["attempts"] == CLIENT.max_attempts and poison["response"] is None
    for p in prompts:
        if p["id"] != "p007":
            turns = [r for r in rows if r["prompt_id"] == p["id"]]
            assert [r["turn"] for r in turns] == list(range(len(p["turns"])))
            assert all(r["response"]["choices"] for r in turns)
    assert stats["sent"] == len(rows) - 1 and stats["reused"] == 0 and stats["failed_conversations"] == 1


def test_a_later_turn_carries_the_servers_own_message(tmp_path, verifier):
    write_prompts(tmp_path / "prompts.jsonl", 6)
    with fake_openai("--lifetime", "60") as url:
        generate(tmp_path / "prompts.jsonl", url, tmp_path / "run", verifier)
    rows = {r["id"]: r for r in read_replies(tmp_path / "run/replies.parquet")}
    first, second = rows["p000#t0"], rows["p000#t1"]
    carried = second["request"]["messages"][-2]
    sent = first["response"]["choices"][0]["message"]
    # The fake server sends `reasoning: null`: empty fields are left out, the rest is verbatim.
    assert carried == {"role": "assistant", "content": sent["content"]}
    assert second["request"]["messages"][:1] == first["request"]["messages"]


def test_a_rerun_retries_failed_conversations_and_reuses_every_stored_reply(tmp_path, verifier):
    write_prompts(tmp_path / "prompts.jsonl", 12)
    with fake_openai("--fault-rate", "1.0", "--hang", "3", "--lifetime", "60") as down:
        stats = generate(
            tmp_path / "prompts.jsonl", down, tmp_path / "run", verifier, client=Client(8, True, 1.0, 1, None, "auto")
        )
    assert stats["failed_conversations"] == 12 and stats["sent"] == 0
    with fake_openai("--lifetime", "60") as up:
        stats = generate(tmp_path / "prompts.jsonl", up, tmp_path / "run", verifier)
        assert (stats["sent"], served(up)) == (15, 15)  # prompts 0, 5, 10 have two turns
        again = generate(tmp_path / "prompts.jsonl", up, tmp_path / "run", verifier)
        assert served(up) == 15, "a rerun sent a request the store holds"
    assert again == {
        **again,
        "sent": 0,
        "reused": 15,
        "failed_conversations": 0,
        "store_entries": 15,
        "store_entries_unused": 0,
    }


def test_the_store_is_keyed_by_the_request_not_by_eagleflows_code(tmp_path, verifier):
    """Another max_tokens changes every request; an edited later turn changes only that turn;
    a copy of the code with a changed parser reuses everything."""
    prompts = write_prompts(tmp_path / "prompts.jsonl", 10)  # p000 and p005 have two turns
    with fake_openai("--lifetime", "120") as url:
        assert generate(tmp_path / "prompts.jsonl", url, tmp_path / "run", verifier)["sent"] == 12
        prompts[5]["turns"][1] = "another follow-up"
        write_jsonl(tmp_path / "prompts.jsonl", prompts)
        stats = generate(tmp_path / "prompts.jsonl", url, tmp_path / "run", verifier)
        assert (stats["sent"], stats["reused"], stats["store_entries_unused"]) == (1, 11, 1)
        longer = Requests(model="verifier", sampling={"max_tokens": 13, "temperature": 0.0}, chat_template_kwargs={})
        assert generate(tmp_path / "prompts.jsonl", url, tmp_path / "run", verifier, requests=longer)["sent"] == 12

        copy = tmp_path / "code"
        shutil.copytree(REPO / "workflow/eagleflow", copy / "eagleflow", ignore=shutil.ignore_patterns("__pycache__"))
        assemble = copy / "eagleflow/synth/assemble.py"
        assemble.write_text(
            assemble.read_text().replace(
                'REASONING_FIELDS = ("reasoning", "reasoning_content")', 'REASONING_FIELDS = ("reasoning_content",)'
            )
        )
        job = synth_job(
            tmp_path / "prompts.jsonl", url, tmp_path / "run", verifier, env={**os.environ, "PYTHONPATH": str(copy)}
        )
        _, err = job.communicate(timeout=120)
        assert job.returncode == 0, err
    assert json.loads((tmp_path / "run/stats.json").read_text())["sent"] == 0


def test_several_endpoints_share_the_load(tmp_path, verifier):
    write_prompts(tmp_path / "prompts.jsonl", 40)
    with (
        fake_openai("--latency", "0.05", "--lifetime", "120") as a,
        fake_openai("--latency", "0.05", "--lifetime", "120") as b,
    ):
        stats = generate(tmp_path / "prompts.jsonl", [a, b], tmp_path / "run", verifier)
        load = [served(u) for u in (a, b)]
    assert stats["sent"] == 48
    assert min(load) >= 0.3 * sum(load), f"load was not shared: {load}"


def limit_at(trace: list, t: float) -> int:
    """The limit in force at t seconds (a step function of the trace's points)."""
    current = trace[0][1]
    for at, limit, _ in trace:
        if at > t:
            break
        current = limit
    return current


def test_concurrency_follows_a_server_whose_capacity_changes_and_nothing_is_lost(tmp_path, verifier, monkeypatch):
    """A server that refuses (503) what it cannot hold: 12 requests at once, 3 from 3 s on,
    8 from 6 s on. The adaptive limit (ceiling 32) follows it down and up again; every turn is
    answered exactly once. The same run at a fixed 32 is refused many times more often."""
    monkeypatch.setattr(RetryPolicy, "delay", lambda self, attempt: 0.05)
    prompts = write_prompts(tmp_path / "prompts.jsonl", 600)
    turns = sum(len(p["turns"]) for p in prompts)
    runs = {}
    for adaptive in (True, False):
        client = Client(
            concurrency=32,
            adaptive=adaptive,
            request_timeout_s=5,
            max_attempts=1000,
            api_key_env=None,
            store_locking="auto",
        )
        with fake_openai("--latency", "0.1", "--capacity", "12@0,3@3,8@6", "--lifetime", "300") as url:
            stats = generate(tmp_path / "prompts.jsonl", url, tmp_path / f"run-{adaptive}", verifier, client=client)
            server = httpx2.get(f"{url}/stats").json()
        assert (stats["sent"], stats["failed_conversations"], stats["store_entries"]) == (turns, 0, turns)
        accepted = sum(phase["accepted"] for phase in server["phases"])
        assert accepted == turns, "a turn was generated twice (or never)"
        runs[adaptive] = (stats["concurrency"], server)

    trace = runs[True][0]["trace"]
    offset = runs[True][0]["started_at"] - runs[True][1]["started_at"]  # server clock = trace clock + offset
    phases = runs[True][1]["phases"]
    for phase, after in zip(phases, [*phases[1:], None], strict=True):
        # Sample the limit from 1.5 s into the phase (time to adapt) to its end (or the run's).
        start = phase["from_s"] + 1.5 - offset
        end = (after["from_s"] if after else phase["from_s"] + 3) - offset
        if end > trace[-1][0]:
            continue  # the run ended before this phase had settled
        samples = [limit_at(trace, start + k * (end - start) / 10) for k in range(11)]
        cap = phase["capacity"]
        assert max(samples) <= cap + 2 and sum(samples) / len(samples) >= 0.4 * cap, (cap, samples, trace)
    refused = {adaptive: sum(p["refused"] for p in server["phases"]) for adaptive, (_, server) in runs.items()}
    assert refused[True] * 3 < refused[False], refused


def test_an_endpoint_that_goes_away_is_waited_for_within_its_budget(tmp_path, verifier):
    """server.endpoint: the server exits mid-run (its --lifetime) and another comes up on the
    same port 4 s later: the run waits, resumes and sends every turn once. Without a second
    server, the job fails once server.endpoint_wait_s is spent, and says so."""
    prompts = write_prompts(tmp_path / "prompts.jsonl", 60)
    turns = sum(len(p["turns"]) for p in prompts)
    port = str(free_port("127.0.0.1"))
    done = threading.Event()

    def second_server():
        time.sleep(4)
        with fake_openai("--port", port, "--latency", "0.05", "--lifetime", "120"):
            done.wait(120)

    client = Client(
        concurrency=4, adaptive=True, request_timeout_s=5, max_attempts=4, api_key_env=None, store_locking="auto"
    )
    with fake_openai("--port", port, "--latency", "0.1", "--lifetime", "1.5") as url:
        revive = threading.Thread(target=second_server)
        revive.start()
        try:
            stats = generate(tmp_path / "prompts.jsonl", url, tmp_path / "run", verifier, client=client)
        finally:
            done.set()
            revive.join()
    assert (stats["sent"], stats["failed_conversations"], stats["store_entries"]) == (turns, 0, turns)

    with fake_openai("--port", port, "--latency", "0.1", "--lifetime", "1.5") as url:
        with pytest.raises(ServerError, match=r"has not answered for \d+ s in this job \(server.endpoint_wait_s: 2\)"):
            generate(tmp_path / "prompts.jsonl", url, tmp_path / "gone", verifier, client=client, endpoint_wait_s=2)
    assert 0 < stored_replies(tmp_path / "gone/store.sqlite") < turns, "what was answered before is kept"


def test_a_corrupt_store_is_refused_with_what_to_do(tmp_path):
    bad = tmp_path / "store.sqlite"
    bad.write_bytes(b"this is not a database" * 100)
    with pytest.raises(StoreError, match="Move it aside"):
        ResponseStore(bad).get("k")


def test_prune_keeps_exactly_the_entries_current_replies_use(tmp_path, verifier):
    write_prompts(tmp_path / "prompts.jsonl", 10)
    with fake_openai("--lifetime", "60") as url:
        generate(tmp_path / "prompts.jsonl", url, tmp_path / "run", verifier)
        write_prompts(tmp_path / "prompts.jsonl", 4)  # a smaller prompt set: 6 conversations unused
        stats = generate(tmp_path / "prompts.jsonl", url, tmp_path / "run", verifier)
    assert (stats["sent"], stats["store_entries_unused"]) == (0, 12 - 5)
    store, replies = tmp_path / "run/store.sqlite", tmp_path / "run/replies.parquet"
    cli = [sys.executable, "-m", "eagleflow.generate"]
    out = subprocess.run(
        [*cli, "prune", str(store), "--keep", str(replies)], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert "removed 7 of 12 replies; 5 kept" in out.stdout
    with ResponseStore(store) as s:
        assert s.keys() == {r["key"] for r in read_replies(replies)}
    missing = subprocess.run([*cli, "stats", str(tmp_path / "nope.sqlite")], cwd=REPO, capture_output=True, text=True)
    assert missing.returncode != 0 and "no such response store" in missing.stderr


GENERATE_JOB = textwrap.dedent(
    """
    import json, logging, sys, yaml
    from eagleflow.runtime.process import terminate_on_sigterm
    from eagleflow.runtime.spec import ServerConfig
    from eagleflow.generate.run import Client, Requests, run_generate
    logging.basicConfig(level=logging.INFO)
    terminate_on_sigterm()  # as every Snakemake entry point does
    prompts, url, out, verifier = sys.argv[1:5]
    server = ServerConfig.from_section({**yaml.safe_load(open(sys.argv[5]))["server"], "endpoint": url})
    run_generate(prompts, verifier, out + "/store.sqlite", out + "/replies.parquet", out + "/stats.json",
                 requests=Requests("verifier", {"max_tokens": 12, "temperature": 0.0}, {}),
                 client=Client(8, True, 5.0, 4, None, "auto"), server=server, server_log=out + "/vllm.log")
    """
)


def synth_job(prompts: Path, url: str, d: Path, verifier: Path, env=None) -> subprocess.Popen:
    d.mkdir(parents=True, exist_ok=True)
    args = [
        sys.executable,
        "-c",
        GENERATE_JOB,
        str(prompts),
        url,
        str(d),
        str(verifier),
        str(REPO / "config/config.yaml"),
    ]
    return subprocess.Popen(
        args, cwd=REPO if env is None else d, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def interrupt(job: subprocess.Popen, out: Path, after: int, sig: int) -> float:
    """Send `sig` once `after` replies are stored; return seconds until the job ended."""
    deadline = time.monotonic() + 60
    while stored_replies(out / "store.sqlite") < after and time.monotonic() < deadline:
        time.sleep(0.05)
    job.send_signal(sig)
    sent = time.monotonic()
    job.wait(timeout=30)
    return time.monotonic() - sent


def test_sigkill_then_rerun_gives_the_same_replies_and_sends_each_request_once(tmp_path, verifier):
    prompts = tmp_path / "prompts.jsonl"
    write_prompts(prompts, 80)  # 96 requests
    with fake_openai("--latency", "0.1", "--lifetime", "300") as url:
        full = tmp_path / "full"
        assert synth_job(prompts, url, full, verifier).wait(timeout=120) == 0

        killed = tmp_path / "killed"
        before = served(url)
        interrupt(synth_job(prompts, url, killed, verifier), killed, 20, signal.SIGKILL)
        partial = stored_replies(killed / "store.sqlite")
        assert 20 <= partial < 96, f"kill landed at {partial} of 96 replies"
        assert not (killed / "replies.parquet").exists()

        rerun = synth_job(prompts, url, killed, verifier)
        _, err = rerun.communicate(timeout=120)
        assert rerun.returncode == 0, err
        # At most the requests in flight at the kill (concurrency 8) are sent twice.
        assert served(url) - before <= 96 + 8
    stats = json.loads((killed / "stats.json").read_text())
    assert stats["reused"] == partial and stats["sent"] == 96 - partial
    strip = lambda rows: sorted((r["id"], r["key"], json.dumps(r["response"], sort_keys=True)) for r in rows)  # noqa: E731
    assert strip(read_replies(killed / "replies.parquet")) == strip(read_replies(full / "replies.parquet"))


def test_sigterm_stops_promptly_and_loses_nothing(tmp_path, verifier):
    prompts = tmp_path / "prompts.jsonl"
    write_prompts(prompts, 80)
    with fake_openai("--latency", "0.1", "--lifetime", "300") as url:
        out = tmp_path / "run"
        job = synth_job(prompts, url, out, verifier)
        assert interrupt(job, out, 10, signal.SIGTERM) < 10
        assert job.returncode != 0
        kept = stored_replies(out / "store.sqlite")
        rerun = synth_job(prompts, url, out, verifier)
        _, err = rerun.communicate(timeout=120)
    assert rerun.returncode == 0, err
    stats = json.loads((out / "stats.json").read_text())
    assert kept >= 10 and stats["reused"] == kept and stats["sent"] == 96 - kept


# One generate shard job, as workflow/rules/generate.smk runs it: its conversations, its store file.
SHARD_JOB = textwrap.dedent(
    """
    import json, logging, sys, yaml
    from eagleflow.runtime.process import terminate_on_sigterm
    from eagleflow.runtime.spec import ServerConfig
    from eagleflow.generate.run import Client, Requests, Shard, run_generate
    logging.basicConfig(level=logging.INFO)
    terminate_on_sigterm()
    prompts, url, out, verifier, part, config = sys.argv[1:7]
    server = ServerConfig.from_section({**yaml.safe_load(open(config))["server"], "endpoint": url})
    run_generate(prompts, verifier, out + "/store.sqlite", f"{out}/shards/{part}/replies.parquet",
                 f"{out}/shards/{part}/stats.json", requests=Requests("verifier", {"max_tokens": 12,
                 "temperature": 0.0}, {}), client=Client(8, True, 5.0, 4, None, "auto"), server=server,
                 server_log=f"{out}/{part}.vllm.log", shard=Shard.parse(part))
    """
)


def shard_job(prompts: Path, url: str, d: Path, verifier: Path, part: str) -> subprocess.Popen:
    args = [sys.executable, "-c", SHARD_JOB, str(prompts), url, str(d), str(verifier), part]
    args.append(str(REPO / "config/config.yaml"))
    return subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def shards_of(n: int) -> list[str]:
    return [f"{i}-of-{n}" for i in range(n)]


def join(prompts: Path, d: Path, n: int) -> dict:
    parts = shards_of(n)
    join_shards(
        str(prompts),
        [str(d / f"shards/{p}/replies.parquet") for p in parts],
        [str(d / f"shards/{p}/stats.json") for p in parts],
        str(d / "replies.parquet"),
        str(d / "stats.json"),
    )
    return json.loads((d / "stats.json").read_text())


def finish(job: subprocess.Popen) -> None:
    _, err = job.communicate(timeout=120)
    assert job.returncode == 0, err


def test_shard_jobs_killed_and_resharded_join_to_one_jobs_replies_sending_each_request_once(tmp_path, verifier):
    """Two shard jobs at once, each with its own store file; one SIGKILLed mid-way: its rerun
    sends only its missing requests, and the joined replies equal one job's, row for row.
    Then three shards over the same store: not one request is sent again."""
    prompts = tmp_path / "prompts.jsonl"
    write_prompts(prompts, 80)  # 96 requests
    with fake_openai("--latency", "0.1", "--lifetime", "300") as url:
        full = tmp_path / "full"
        finish(synth_job(prompts, url, full, verifier))
        one_job = read_replies(full / "replies.parquet")

        d = tmp_path / "sharded"
        before = served(url)
        first, second = (shard_job(prompts, url, d, verifier, p) for p in shards_of(2))
        deadline = time.monotonic() + 60
        while stored_replies(d / "store.1-of-2.sqlite") < 10 and time.monotonic() < deadline:
            time.sleep(0.05)
        second.send_signal(signal.SIGKILL)
        second.wait(timeout=30)
        finish(first)
        partial = stored_replies(d / "store.1-of-2.sqlite")
        assert not (d / "shards/1-of-2/stats.json").exists()
        finish(shard_job(prompts, url, d, verifier, "1-of-2"))
        # At most the requests in flight at the kill (concurrency 8) were sent twice.
        assert served(url) - before <= 96 + 8
        stats = join(prompts, d, 2)
        rerun = json.loads((d / "shards/1-of-2/stats.json").read_text())
        assert rerun["reused"] == partial and rerun["sent"] == rerun["requests"] - partial
        first_stats = json.loads((d / "shards/0-of-2/stats.json").read_text())
        assert 0 < first_stats["conversations"] < 80 and first_stats["sent"] == first_stats["requests"]
        assert stats["conversations"] == 80 and stats["requests"] == 96
        assert stats["sent"] + stats["reused"] == 96
        assert not (d / "store.sqlite").exists(), "a shard wrote the configured file"

        # Three shards, the same store: every reply is found in the two-shard files.
        before = served(url)
        jobs = [shard_job(prompts, url, d, verifier, p) for p in shards_of(3)]
        for job in jobs:
            finish(job)
        assert served(url) == before
        three = join(prompts, d, 3)
        assert three["sent"] == 0 and three["reused"] == 96
        assert sum(s["store_entries_adopted"] for s in three["shards"]) == 96

    def rows(path):
        return [(r["id"], r["key"], json.dumps(r["request"]), json.dumps(r["response"])) for r in read_replies(path)]

    assert rows(d / "replies.parquet") == [
        (r["id"], r["key"], json.dumps(r["request"]), json.dumps(r["response"])) for r in one_job
    ]
