"""generate and synth against a real vLLM serving a thinking verifier (kimi_k2 reasoning
parser, single-token <think>/</think>): exact token streams, reasoning and content in their
fields, the text rebuild agreeing with the server's ids, and the incident this project exists
for, replayed through the DAG: a broken parser costs no inference once fixed."""

import dataclasses
import json
import subprocess
from pathlib import Path

import httpx2
import pyarrow.parquet as pq
import pytest
import yaml
from transformers import AutoTokenizer

from devkit.configs import lean_server_config
from devkit.runs import copy_workflow, planned_jobs
from eagleflow.common.atomic import write_jsonl
from eagleflow.generate.run import Client, Requests, run_generate
from eagleflow.runtime.spec import ServerSpec
from eagleflow.runtime.vllm_server import VllmServer
from eagleflow.synth.run import Parsing, run_synth
from tests.helpers import SNAKEMAKE, vllm_available

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]

THINK_START, THINK_END, EOS = 3, 4, 2  # ids in tests.conftest.char_tokenizer(think=True)
# A random model: sampling with a bias towards </think> and the end token makes it think a
# few tokens, close the block, answer and stop. Greedy decoding cannot: the bias wins at the
# first step or never. Seeded sampling is deterministic per request in vLLM.
SAMPLING = {"max_tokens": 48, "temperature": 1.0, "seed": 0, "logit_bias": {str(THINK_END): 3.5, str(EOS): 3.0}}
SERVER = lean_server_config(max_model_len=512, reasoning_parser="kimi_k2")


@pytest.fixture(scope="module")
def server(tiny_think_dir, tmp_path_factory):
    """One vLLM for the module: the DAG runs below use it as `server.endpoint`, so its own
    request counters count every request any of them sent."""
    spec = ServerSpec.from_config(SERVER, str(tiny_think_dir))
    with VllmServer(spec, tmp_path_factory.mktemp("vllm") / "vllm.log") as srv:
        yield srv.base_url


def requests_served(url: str) -> int:
    """vLLM's own count of finished requests (all finish reasons)."""
    text = httpx2.get(f"{url}/metrics").text
    return round(
        sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("vllm:request_success_total{"))
    )


def prompts(n_single: int, n_multi: int) -> list[dict]:
    single = [
        {"id": f"p{i:02d}", "category": "t", "system": None, "turns": [f"question number {i}?"]}
        for i in range(n_single)
    ]
    multi = [
        {"id": f"m{i}", "category": "multi-turn", "system": "be brief", "turns": [f"first {i}", f"second {i}"]}
        for i in range(n_multi)
    ]
    return single + multi


@pytest.fixture(scope="module")
def samples(server, tiny_think_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("think")
    write_jsonl(tmp / "prompts.jsonl", prompts(48, 3))
    run_generate(
        str(tmp / "prompts.jsonl"),
        str(tiny_think_dir),
        str(tmp / "store.sqlite"),
        str(tmp / "replies.parquet"),
        str(tmp / "stats.json"),
        requests=Requests("verifier", SAMPLING, {}),
        client=Client(8, True, 120, 2, None, "auto"),
        server=dataclasses.replace(SERVER, endpoint=server),
        server_log=str(tmp / "vllm.log"),
    )
    parsing = Parsing(
        expect_reasoning=True,
        think_markers=("<think>", "</think>"),
        chat_template_kwargs={},
        verify_token_ids=True,
        trust_remote_code=False,
    )
    run_synth(
        str(tmp / "replies.parquet"),
        str(tmp / "responses.parquet"),
        str(tmp / "errors.jsonl"),
        str(tmp / "quality.json"),
        parsing,
        verifier_dir=str(tiny_think_dir),
    )
    rows = pq.read_table(tmp / "responses.parquet").to_pylist()
    assert len(rows) == 48 + 3 * 2
    return rows, json.loads((tmp / "quality.json").read_text())


def is_clean(ids):
    """Exactly one </think>, and no special token in the answer but a final end token."""
    body = ids[:-1] if ids and ids[-1] == EOS else ids
    return body.count(THINK_END) == 1 and not any(t < 5 and t != THINK_END for t in body)


def test_stream_is_the_servers_and_markers_are_single_tokens(samples):
    rows, _ = samples
    for r in rows:
        assert r["token_source"] == "server"
        assert r["prompt_token_ids"][-1] == THINK_START, "the template opens the think block in the prompt"
        assert len(r["completion_token_ids"]) == r["completion_tokens"]


def test_reasoning_and_content_land_in_their_fields(tiny_think_dir, samples):
    rows, _ = samples
    tok = AutoTokenizer.from_pretrained(tiny_think_dir)
    checked = 0
    for r in rows:
        ids = r["completion_token_ids"]
        if THINK_END not in ids or not is_clean(ids):
            continue
        k = ids.index(THINK_END)
        answer = ids[k + 1 : -1] if ids[-1] == EOS else ids[k + 1 :]
        assert (r["reasoning"] or "") == tok.decode(ids[:k])
        assert (r["content"] or "") == tok.decode(answer)
        checked += 1
    assert checked >= 8, f"only {checked} samples closed their think block once"


def test_text_rebuild_agrees_with_server_ids_on_every_clean_sample(samples):
    rows, quality = samples
    clean = [r for r in rows if is_clean(r["completion_token_ids"])]
    assert len(clean) >= 8
    assert all("token_mismatch" not in r["defects"] for r in clean)
    # A second </think> or an end token inside the answer is stripped from the content text,
    # so its rebuild cannot match: those samples must be flagged, never silently kept.
    for r in rows:
        ids = r["completion_token_ids"]
        if ids.count(THINK_END) > 1:
            assert "token_mismatch" in r["defects"]
    assert quality["counts"]["token_mismatch"] == sum("token_mismatch" in r["defects"] for r in rows)


def test_multi_turn_history_carries_the_verifiers_reply_and_drops_its_reasoning(tiny_think_dir, samples):
    rows, _ = samples
    tok = AutoTokenizer.from_pretrained(tiny_think_dir)
    by_id = {r["id"]: r for r in rows}
    for i in range(3):
        first, second = by_id[f"m{i}#t0"], by_id[f"m{i}#t1"]
        history = json.loads(second["messages"])
        assert [m["role"] for m in history] == ["system", "user", "assistant", "user"]
        assert history[2]["content"] == (first["content"] or "")
        # vLLM 0.32 sends `reasoning` and reads only `reasoning` back: the history carries it.
        assert history[2].get("reasoning") == first["reasoning"] and "reasoning_content" not in history[2]
        rendered = tok.decode(second["prompt_token_ids"])
        assert f"<|im_start|>assistant\n<think></think>{first['content'] or ''}<|im_end|>" in rendered
        if first["reasoning"]:
            assert first["reasoning"] not in rendered.split("<|im_start|>user")[-2]


# ----------------------------------------------------------------------------------------
# The incident, replayed through the DAG


def incident_config(wf: Path, verifier: Path, url: str) -> Path:
    write_jsonl(wf / "prompts.jsonl", prompts(30, 6))
    config = {
        "run": "incident",
        "verifier": {"name": "tiny-think", "source": "path", "path": str(verifier)},
        "server": {"endpoint": url, "max_model_len": 512, "reasoning_parser": "kimi_k2"},
        # Templated prompts ("first 3", "question number 12?"): the length and near-duplicate
        # filters would drop most of them, and they are not what is tested here.
        "prompts": {
            "source": "prompts.jsonl",
            "eval_fraction": 0.25,
            "filters": {"min_chars": 1, "near_duplicate": None},
        },
        "generate": {
            "concurrency": 4,
            **{k: v for k, v in SAMPLING.items() if k != "logit_bias"},
            "extra_body": {"logit_bias": SAMPLING["logit_bias"]},
        },
        "synth": {"expect_reasoning": True, "think_markers": ["<think>", "</think>"]},
        "dataset": {
            "max_seq_len": 256,
            "eval_fraction": 0.3,
            # A random verifier often closes its think block and stops at once: only
            # the reasoning field, which the incident empties, is held to a limit.
            "max_defect_fraction": {
                "request_errors": 0.0,
                "empty_reasoning": 0.5,
                "empty_content": 1.0,
                "duplicate": 1.0,
            },
        },
    }
    (wf / "incident.yaml").write_text(yaml.safe_dump(config))
    return wf / "incident.yaml"


DATASET = ["results/incident/dataset/train.parquet", "results/incident/dataset/eval.parquet"]


def snakemake(wf: Path, *options: str, check: bool = True) -> subprocess.CompletedProcess:
    """Build the dataset; targets first: --configfile takes every word after it."""
    cmd = [*SNAKEMAKE, *DATASET, "--cores", "2", *options, "--configfile", "incident.yaml"]
    proc = subprocess.run(cmd, cwd=wf, capture_output=True, text=True, timeout=900)
    if check and proc.returncode != 0:
        logs = "\n".join(
            f"--- {p}\n{p.read_text()[-2000:]}" for p in sorted((wf / "results/incident/logs").glob("*.log"))
        )
        pytest.fail(f"snakemake {' '.join(options)} failed:\n{proc.stderr[-3000:]}\n{logs}")
    return proc


def break_the_parser(wf: Path) -> str:
    """The incident: read only `reasoning_content` (vLLM sends `reasoning`) and glue reasoning
    and answer together as text, without the think markers. Returns the original source."""
    path = wf / "workflow/eagleflow/synth/assemble.py"
    original = path.read_text()
    broken = original.replace(
        'REASONING_FIELDS = ("reasoning", "reasoning_content")', 'REASONING_FIELDS = ("reasoning_content",)'
    )
    broken = broken.replace(
        'content=message.get("content"),', 'content=(reasoning_of(message) or "") + (message.get("content") or ""),'
    )
    assert 'REASONING_FIELDS = ("reasoning_content",)' in broken and "+ (message.get" in broken, (
        "the patch no longer applies"
    )
    path.write_text(broken)
    return original


def planned(wf: Path) -> dict[str, str]:
    """{rule: reason} of what `snakemake -n` would run."""
    return planned_jobs(snakemake(wf, "-n").stdout)


def test_a_parser_fix_costs_no_inference_and_gives_the_data_of_a_fresh_run(server, tiny_think_dir, tmp_path):
    wf = copy_workflow(tmp_path / "incident")
    incident_config(wf, tiny_think_dir, server)
    original = break_the_parser(wf)

    before = requests_served(server)
    broken = snakemake(wf, check=False)
    sent_by_broken_run = requests_served(server) - before
    train_prompts = [
        json.loads(line) for line in (wf / "results/incident/prompts/train.jsonl").read_text().splitlines()
    ]
    turns = sum(len(p["turns"]) for p in train_prompts)
    assert sent_by_broken_run == turns
    assert broken.returncode != 0
    log = (wf / "results/incident/logs/dataset.log").read_text()
    assert "quality gate refused" in log and "empty_reasoning:" in log
    quality = json.loads((wf / "results/incident/synth/quality.json").read_text())
    assert quality["counts"]["empty_reasoning"] + quality["counts"]["unterminated_reasoning"] == turns, quality[
        "counts"
    ]

    (wf / "workflow/eagleflow/synth/assemble.py").write_text(original)  # the fix
    plan = planned(wf)
    # Snakemake tracks a script rule's code through the `code` param: the reason names it.
    assert "generate" not in plan and "Params have changed" in plan["synth"] and "of entry/synth.py" in plan["synth"], (
        plan
    )
    before = requests_served(server)
    snakemake(wf)
    assert requests_served(server) - before == 0, "the fixed run sent requests the store holds"
    fixed = json.loads((wf / "results/incident/synth/quality.json").read_text())
    assert fixed["fractions"]["empty_reasoning"] < 0.5 < quality["fractions"]["empty_reasoning"]
    assert json.loads((wf / "results/incident/generate/stats.json").read_text())["sent"] == sent_by_broken_run

    # (A forced generate rerun is answered by the store the same way: tests/integration/test_generate.py.)

    # A later turn edited in the prompt file: that one request is sent, the rest reused.
    source = [json.loads(line) for line in (wf / "prompts.jsonl").read_text().splitlines()]
    edited = next(p for p in source if p["id"] in {t["id"] for t in train_prompts} and len(p["turns"]) == 2)
    edited["turns"][1] = "a different second question"
    write_jsonl(wf / "prompts.jsonl", source)
    before = requests_served(server)
    snakemake(wf)
    assert requests_served(server) - before == 1

    fresh = copy_workflow(tmp_path / "fresh")
    incident_config(fresh, tiny_think_dir, server)
    write_jsonl(fresh / "prompts.jsonl", source)
    snakemake(fresh)
    for name in DATASET:
        fixed, scratch = pq.read_table(wf / name).to_pylist(), pq.read_table(fresh / name).to_pylist()
        assert [r["id"] for r in fixed] == [r["id"] for r in scratch]
        differ = [a["id"] for a, b in zip(fixed, scratch, strict=True) if a != b]
        assert not differ, f"{name}: samples differ between the fixed run and a fresh one: {differ}"


def test_a_benchmark_row_above_temperature_zero_samples_the_same_again_with_its_seed(server):
    """The benchmark's rows above temperature 0 name their seed (benchmark.seed, per request):
    measured again with it, every output is the same; with another seed they are not. One
    request at a time, so the batches are the same too (this module's server, no draft)."""
    import asyncio

    from eagleflow.benchmark.workload import Workload, measure_cell
    from eagleflow.runtime.client import ChatClient

    questions = {
        "name": "eval",
        "prompts": [{"id": f"q{i}", "system": None, "turns": [f"question {i}?"]} for i in range(3)],
    }

    async def sampled(seed: int) -> dict:
        workload = Workload(16, 1, (0.0, 1.0), seed, 120.0, {})
        async with ChatClient(server, concurrency=1, request_timeout_s=120.0) as client:
            cell = await measure_cell(client, questions, 1.0, workload, SERVER.served_model_name, "seed", None)
        assert cell["seed"] == seed
        return cell["outputs"]

    first = asyncio.run(sampled(7))
    assert all(out[0] for out in first.values()), first
    assert asyncio.run(sampled(7)) == first
    assert asyncio.run(sampled(8)) != first


def test_an_endpoint_that_is_not_the_server_the_keys_assume_is_refused(server):
    """What a real vLLM reports (/version, /v1/models) matches the launch the keys assume;
    another maximum length, another served name or another vLLM version is refused by name."""
    from eagleflow.runtime.endpoint_identity import EndpointMismatch, Expected, check_endpoint, local_vllm_version

    version = local_vllm_version()
    reported = check_endpoint(server, Expected(SERVER.served_model_name, SERVER.max_model_len, version))
    assert reported["version"] and reported["version"].split("+")[0] == version.split("+")[0]
    (model,) = reported["models"]
    assert model["max_model_len"] == SERVER.max_model_len and model["root"]
    for expected, named in (
        (Expected(SERVER.served_model_name, 1024, version), "max_model_len is 512"),
        (Expected("other", SERVER.max_model_len, version), "not 'other'"),
        (Expected(SERVER.served_model_name, SERVER.max_model_len, "0.1.0"), "the keys assume 0.1.0"),
    ):
        with pytest.raises(EndpointMismatch, match=named):
            check_endpoint(server, expected)
