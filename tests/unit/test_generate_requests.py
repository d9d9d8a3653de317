"""What generate asks and under which store key (common/requests.py): pure functions."""

import json
import shutil

from devkit.configs import server_config
from eagleflow.common.identity import verifier_fingerprint
from eagleflow.common.requests import (
    history_message,
    request_key,
    request_payload,
    sample_seed,
    server_identity,
)
from eagleflow.runtime.spec import ServerSpec

PAYLOAD = {"model": "verifier", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def write_verifier(d):
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "fake"}))
    return d


def launched(verifier, **server) -> list[str]:
    """The argv the launcher starts vLLM with for `verifier` and these server settings."""
    return ServerSpec.from_config(server_config(**server), str(verifier)).command(port=8000)


def test_another_verifier_or_reply_shaping_flag_is_another_key(tmp_path):
    verifier = write_verifier(tmp_path / "verifier")
    base = server_identity(verifier, launched(verifier))
    assert request_key(PAYLOAD, base) == request_key(
        json.loads(json.dumps(PAYLOAD)), server_identity(verifier, launched(verifier))
    )
    for changed in (
        {"dtype": "bfloat16"},
        {"extra_args": ["--max-logprobs", "5"]},
        {"reasoning_parser": "qwen3"},
        {"enforce_eager": False},  # compiled, fused kernels
        {"tensor_parallel_size": 2},  # another reduction order
    ):
        other = server_identity(verifier, launched(verifier, **changed))
        assert request_key(PAYLOAD, base) != request_key(PAYLOAD, other)
    # Capacity and placement, not content: the same key.
    fast = {
        "host": "0.0.0.0",
        "extra_args": ["--gpu-memory-utilization", "0.5", "--max-num-seqs", "4"],
        "env": {"X": "1"},
    }
    assert request_key(PAYLOAD, base) == request_key(PAYLOAD, server_identity(verifier, launched(verifier, **fast)))

    other = tmp_path / "other"
    shutil.copytree(verifier, other)
    # The same files at another path: the same server, the same key.
    assert request_key(PAYLOAD, base) == request_key(PAYLOAD, server_identity(other, launched(other)))
    assert verifier_fingerprint(other) == verifier_fingerprint(verifier)  # a copy is the same verifier
    (other / "README.md").write_text("docs do not change replies")
    (other / "eagleflow_source.json").write_text('{"file": "/another/venv/model.gguf"}')  # where it was found
    assert verifier_fingerprint(other) == verifier_fingerprint(verifier)
    (other / "config.json").write_text(json.dumps({"model_type": "fake", "rope_theta": 1.0}))
    assert verifier_fingerprint(other) != verifier_fingerprint(verifier)


def test_each_sample_gets_its_own_stable_seed():
    seeds = {sample_seed(0, f"p{i}", t) for i in range(50) for t in range(2)}
    assert len(seeds) == 100 and all(0 <= s < 2**31 for s in seeds)
    assert sample_seed(0, "p1", 0) == sample_seed(0, "p1", 0) != sample_seed(1, "p1", 0)
    sampling = {"max_tokens": 8, "temperature": 1.0, "seed": 7}
    one = request_payload([], "p1", 1, model="m", sampling=sampling, chat_template_kwargs={"thinking": True})
    assert one["seed"] == sample_seed(7, "p1", 1) and one["return_token_ids"] is True
    assert one["chat_template_kwargs"] == {"thinking": True}
    greedy = request_payload([], "p1", 1, model="m", sampling={"max_tokens": 8}, chat_template_kwargs={})
    assert "seed" not in greedy and "chat_template_kwargs" not in greedy


def test_history_carries_the_servers_message_without_empty_fields():
    body = {
        "choices": [
            {"message": {"role": "assistant", "content": "4", "reasoning": "2+2", "tool_calls": [], "refusal": None}}
        ]
    }
    assert history_message(body) == {"role": "assistant", "reasoning": "2+2", "content": "4"}
    assert history_message({"choices": [{"message": {"role": "assistant", "content": None}}]}) == {
        "role": "assistant",
        "content": "",
    }


def test_longest_request_is_estimated_on_the_long_side():
    from eagleflow.generate.run import longest_request_tokens

    one = {"id": "a", "turns": ["x" * 300]}
    two = {"id": "b", "turns": ["y" * 30, "z" * 30], "system": "s" * 60}
    # 300 characters at 3 per token, two messages of template, one reply of 100.
    assert longest_request_tokens([one], 100) == 100 + 2 * 16 + 100
    # The second turn's request holds the first reply as well: system, two turns of two messages.
    assert longest_request_tokens([two], 100) == 40 + 5 * 16 + 200
    assert longest_request_tokens([one, two], 100) == 320
    assert longest_request_tokens([one], None) is None and longest_request_tokens([], 100) is None
