"""The synth stage's I/O shell: bounded-concurrency generation, a durable per-sample cache,
then responses.parquet, errors.jsonl and quality.json.

Every finished sample is appended (and fsynced) to a JSONL cache keyed by a fingerprint of
everything that shapes a sample: generator code, verifier, sampling parameters. A restarted
job reloads the cache and generates only what is missing; a cache with another fingerprint
is discarded, so a fixed generator never reuses samples from the broken one.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from workflow_scripts.common.atomic import read_jsonl, write_json, write_jsonl, write_parquet
from workflow_scripts.common.client import ChatClient, RequestFailed, RetryPolicy
from workflow_scripts.common.fingerprint import code_fingerprint, value_fingerprint
from workflow_scripts.synth.assemble import (
    StreamTokens,
    parse_completion,
    rebuild_completion_ids,
    rebuild_prompt_ids,
    stream_tokens,
    verify_stream,
)
from workflow_scripts.synth.quality import quality_report

log = logging.getLogger(__name__)


class SampleCache:
    """Append-only JSONL of finished conversations (and failed ones), one file per fingerprint.

    A conversation may appear twice (failed, then retried by a rerun): the last record wins.
    """

    def __init__(self, directory: Path, fingerprint: str):
        directory.mkdir(parents=True, exist_ok=True)
        for stale in directory.glob("*.jsonl"):
            if stale.stem != fingerprint:
                log.warning("discarding synth cache %s: made with fingerprint %s, now %s", stale, stale.stem, fingerprint)
                stale.unlink()
        self.path = directory / f"{fingerprint}.jsonl"
        self.records: dict[str, dict[str, Any]] = {}
        if self.path.exists():
            self._load()
        self._fh = open(self.path, "a")

    def _load(self) -> None:
        good = 0  # bytes of complete records
        with open(self.path, "rb") as fh:
            for line in fh:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    break  # a torn last line from a killed job: everything after it is unknown
                if not line.endswith(b"\n"):
                    break
                self.records[rec["conversation_id"]] = rec
                good += len(line)
        os.truncate(self.path, good)
        log.info("resuming: %d conversations already in %s", len(self.records), self.path)

    def add(self, rec: dict[str, Any]) -> None:
        self._fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self.records[rec["conversation_id"]] = rec

    def close(self) -> None:
        self._fh.close()


def sample_seed(run_seed: int, prompt_id: str, turn: int) -> int:
    digest = hashlib.sha256(f"{run_seed}:{prompt_id}:{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


class Rebuilder:
    """Rebuilds token streams from text with the verifier's tokenizer and chat template."""

    def __init__(self, tokenizer, tokens: StreamTokens, chat_template_kwargs: dict[str, Any], verify: bool):
        self.tokenizer, self.tokens, self.kwargs, self.verify = tokenizer, tokens, chat_template_kwargs, verify

    def apply(self, c, messages: list[dict[str, Any]]):
        if not self.verify and c.prompt_token_ids is not None and c.completion_token_ids is not None:
            return c
        prompt = rebuild_prompt_ids(self.tokenizer, messages, self.kwargs)
        encode = lambda text: self.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        completion = rebuild_completion_ids(encode, prompt, c.reasoning, c.content, c.finish_reason, self.tokens)
        return verify_stream(c, prompt, completion)


async def generate_conversation(client: ChatClient, prompt: dict[str, Any], params: dict[str, Any], rebuilder: Rebuilder | None = None) -> dict[str, Any]:
    """Generate every assistant turn of one conversation in order.

    The history carries the verifier's own earlier replies, reasoning included as
    `reasoning_content`: the chat template decides whether an earlier turn's reasoning is
    kept or dropped. Each turn is one sample.
    """
    messages: list[dict[str, str]] = []
    if prompt.get("system"):
        messages.append({"role": "system", "content": prompt["system"]})
    samples = []
    for turn, user_text in enumerate(prompt["turns"]):
        messages.append({"role": "user", "content": user_text})
        payload = {"model": params["served_model_name"], "messages": messages, **params["sampling"], "return_token_ids": True}
        if "seed" in payload:
            # One seed per sample, not one for the run: the same seed on every request would
            # correlate all samples; a derived one keeps a resumed run reproducible.
            payload["seed"] = sample_seed(payload["seed"], prompt["id"], turn)
        if params.get("chat_template_kwargs"):
            payload["chat_template_kwargs"] = params["chat_template_kwargs"]
        try:
            body = await client.chat(payload)
        except RequestFailed as exc:
            return {"conversation_id": prompt["id"], "samples": samples, "error": {"turn": turn, "reason": exc.reason, "attempts": exc.attempts}}
        c = parse_completion(body, expect_reasoning=params["expect_reasoning"], think_markers=params.get("think_markers"))
        if rebuilder is not None:
            c = rebuilder.apply(c, messages)
        samples.append({
            "id": f"{prompt['id']}#t{turn}",
            "prompt_id": prompt["id"],
            "turn": turn,
            "category": prompt.get("category"),
            "messages": json.dumps(messages, ensure_ascii=False),
            "reasoning": c.reasoning,
            "content": c.content,
            "finish_reason": c.finish_reason,
            "prompt_token_ids": c.prompt_token_ids,
            "completion_token_ids": c.completion_token_ids,
            "prompt_tokens": c.prompt_tokens,
            "completion_tokens": c.completion_tokens,
            "server_model": c.server_model,
            "system_fingerprint": c.system_fingerprint,
            "token_source": c.token_source,
            "defects": c.defects,
        })  # fmt: skip
        reply = {"role": "assistant", "content": c.content or ""}
        if c.reasoning:
            reply["reasoning_content"] = c.reasoning
        messages = messages + [reply]
    return {"conversation_id": prompt["id"], "samples": samples, "error": None}


async def _generate_all(base_url: str | list[str], prompts: list[dict], cache: SampleCache, cfg: dict[str, Any], rebuilder: Rebuilder | None) -> None:
    # Conversations that failed last time are tried again: the server may be back.
    todo = [p for p in prompts if p["id"] not in cache.records or cache.records[p["id"]]["error"]]
    bar = tqdm(total=len(prompts), initial=len(prompts) - len(todo), desc="synth", unit="conv", mininterval=2.0)
    tokens = errors = samples = 0
    started = time.monotonic()
    sem = asyncio.Semaphore(cfg["concurrency"])
    retry = RetryPolicy(max_attempts=cfg["max_attempts"])
    async with ChatClient(base_url, concurrency=cfg["concurrency"], request_timeout_s=cfg["request_timeout_s"], retry=retry, api_key_env=cfg.get("api_key_env")) as client:

        async def one(prompt):
            nonlocal tokens, errors, samples
            async with sem:
                rec = await generate_conversation(client, prompt, cfg, rebuilder)
            cache.add(rec)
            tokens += sum(s["completion_tokens"] or 0 for s in rec["samples"])
            samples += len(rec["samples"])
            errors += rec["error"] is not None
            elapsed = time.monotonic() - started
            bar.set_postfix(samples_s=f"{samples / elapsed:.2f}", tok_s=f"{tokens / elapsed:.0f}", errors=errors, refresh=False)
            bar.update()

        await asyncio.gather(*(one(p) for p in todo))
    bar.close()


def load_rebuilder(verifier_dir: str | None, cfg: dict[str, Any]) -> Rebuilder | None:
    if verifier_dir is None:
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(verifier_dir, trust_remote_code=cfg.get("trust_remote_code", False))
    tokens = stream_tokens(tokenizer, cfg.get("think_markers"))
    return Rebuilder(tokenizer, tokens, cfg.get("chat_template_kwargs") or {}, cfg.get("verify_token_ids", True))


def run_synth(
    prompts_path: str, base_url: str | list[str], cache_dir: str, responses_out: str, errors_out: str, quality_out: str,
    cfg: dict[str, Any], verifier_dir: str | None = None,
) -> None:  # fmt: skip
    """cfg: served_model_name, sampling{...}, expect_reasoning, concurrency, request_timeout_s,
    max_attempts, api_key_env, verifier (identity for the fingerprint), think_markers,
    chat_template_kwargs, verify_token_ids. `verifier_dir` holds the tokenizer and chat
    template used to rebuild (and check) token streams; None disables that."""
    prompts = read_jsonl(prompts_path)
    fingerprint = value_fingerprint({
        "code": code_fingerprint(__name__),
        "verifier": cfg["verifier"],
        "sampling": cfg["sampling"],
        "expect_reasoning": cfg["expect_reasoning"],
        "stream": [cfg.get("think_markers"), cfg.get("chat_template_kwargs"), cfg.get("verify_token_ids", True), verifier_dir is not None],
    })  # fmt: skip
    rebuilder = load_rebuilder(verifier_dir, cfg)
    cache = SampleCache(Path(cache_dir), fingerprint)
    try:
        asyncio.run(_generate_all(base_url, prompts, cache, cfg, rebuilder))
    finally:
        cache.close()
    records = [cache.records[p["id"]] for p in prompts if p["id"] in cache.records]
    samples = [s for r in records for s in r["samples"]]
    errors = [{"conversation_id": r["conversation_id"], **r["error"]} for r in records if r["error"]]
    write_parquet(responses_out, _samples_table(samples))
    write_jsonl(errors_out, errors)
    report = quality_report(samples, errors, num_prompts=len(prompts))
    report["fingerprint"] = fingerprint
    write_json(quality_out, report)
    log.info("synth: %d samples, %d failed conversations; defects %s", len(samples), len(errors), report["counts"])


def _samples_table(samples: list[dict[str, Any]]):
    import pyarrow as pa

    schema = pa.schema([
        ("id", pa.string()), ("prompt_id", pa.string()), ("turn", pa.int32()), ("category", pa.string()),
        ("messages", pa.string()), ("reasoning", pa.string()), ("content", pa.string()),
        ("finish_reason", pa.string()), ("prompt_token_ids", pa.list_(pa.int32())),
        ("completion_token_ids", pa.list_(pa.int32())), ("prompt_tokens", pa.int32()),
        ("completion_tokens", pa.int32()), ("server_model", pa.string()),
        ("system_fingerprint", pa.string()), ("token_source", pa.string()), ("defects", pa.list_(pa.string())),
    ])  # fmt: skip
    return pa.Table.from_pylist(samples, schema=schema)
