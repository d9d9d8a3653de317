"""synth against a real vLLM serving a thinking verifier: exact token streams, reasoning and
content in their fields, and the text rebuild agreeing with the server's token ids."""

import json

import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from tests.conftest import vllm_available
from workflow_scripts.common.atomic import write_jsonl
from workflow_scripts.common.server import ServerSpec, VllmServer
from workflow_scripts.synth.generate import run_synth

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")]

THINK_START, THINK_END, EOS = 3, 4, 2  # ids in tests.conftest.char_tokenizer(think=True)


@pytest.fixture(scope="module")
def samples(tiny_think_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("think")
    prompts = [{"id": f"p{i:02d}", "category": "t", "system": None, "turns": [f"question number {i}?"]} for i in range(48)]
    prompts += [{"id": f"m{i}", "category": "multi-turn", "system": "be brief", "turns": [f"first {i}", f"second {i}"]} for i in range(3)]
    write_jsonl(tmp / "prompts.jsonl", prompts)
    cfg = {
        "served_model_name": "verifier",
        # A random model: sampling with a bias towards </think> and the end token makes it
        # think a few tokens, close the block, answer and stop.
        "sampling": {"max_tokens": 48, "temperature": 1.0, "seed": 0, "logit_bias": {str(THINK_END): 3.5, str(EOS): 3.0}},
        "expect_reasoning": True,
        "think_markers": ["<think>", "</think>"],
        "verify_token_ids": True,
        "concurrency": 8,
        "request_timeout_s": 120,
        "max_attempts": 2,
        "api_key_env": None,
        "verifier": {"name": "tiny-think"},
    }
    spec = ServerSpec(model=str(tiny_think_dir), dtype="float32", enforce_eager=True, max_model_len=512, reasoning_parser="kimi_k2",
                      env={"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "1"})  # fmt: skip
    with VllmServer(spec, tmp / "vllm.log") as srv:
        run_synth(str(tmp / "prompts.jsonl"), srv.base_url, str(tmp / "cache"), str(tmp / "responses.parquet"),
                  str(tmp / "errors.jsonl"), str(tmp / "quality.json"), cfg, verifier_dir=str(tiny_think_dir))  # fmt: skip
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
        rendered = tok.decode(second["prompt_token_ids"])
        assert f"<|im_start|>assistant\n<think></think>{first['content'] or ''}<|im_end|>" in rendered
        if first["reasoning"]:
            assert first["reasoning"] not in rendered.split("<|im_start|>user")[-2]
