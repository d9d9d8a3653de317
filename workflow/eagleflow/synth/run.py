"""The synth stage's shell: raw replies in (`generate/replies.parquet`), samples out
(`synth/responses.parquet`), plus `errors.jsonl` and `quality.json`.

Pure with respect to the verifier: it parses what the server sent (reasoning and content
fields, token streams), optionally rebuilds and checks token streams with the verifier's
tokenizer and chat template, and classifies defects. It takes seconds, so a fix to any of
this reruns it and what is downstream, never a request.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from eagleflow.common.atomic import parquet_rows, write_json, write_jsonl
from eagleflow.common.config import typed
from eagleflow.common.replies import iter_replies
from eagleflow.runtime.smk import stage
from eagleflow.synth.assemble import (
    Completion,
    StreamTokens,
    parse_completion,
    rebuild_completion_ids,
    rebuild_prompt_ids,
    stream_tokens,
    verify_stream,
)
from eagleflow.synth.quality import Quality

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Parsing:
    """How replies are read: whether reasoning is expected, the think markers, and the token
    stream rebuild (chat template kwargs, whether to check the server's ids against it)."""

    expect_reasoning: bool
    think_markers: tuple[str, str] | None
    chat_template_kwargs: dict[str, Any]
    verify_token_ids: bool
    trust_remote_code: bool


def main(smk) -> None:
    """The synth rule's job (workflow/rules/synth.smk)."""
    with stage(smk):
        run_synth(
            smk.input.replies,
            smk.output.responses,
            smk.output.errors,
            smk.output.quality,
            typed(Parsing, smk.params.parsing, "synth"),
            verifier_dir=smk.input.verifier,
        )


class Rebuilder:
    """Rebuilds token streams from text with the verifier's tokenizer and chat template."""

    def __init__(self, tokenizer, tokens: StreamTokens, chat_template_kwargs: dict[str, Any], verify: bool):
        self.tokenizer, self.tokens, self.kwargs, self.verify = tokenizer, tokens, chat_template_kwargs, verify

    def apply(self, c: Completion, messages: list[dict[str, Any]]) -> Completion:
        if not self.verify and c.prompt_token_ids is not None and c.completion_token_ids is not None:
            return c
        prompt = rebuild_prompt_ids(self.tokenizer, messages, self.kwargs)
        encode = lambda text: self.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        completion = rebuild_completion_ids(encode, prompt, c.reasoning, c.content, c.finish_reason, self.tokens)
        return verify_stream(c, prompt, completion)


def load_rebuilder(verifier_dir: str | None, parsing: Parsing) -> Rebuilder | None:
    if verifier_dir is None:
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(verifier_dir, trust_remote_code=parsing.trust_remote_code)
    tokens = stream_tokens(tokenizer, parsing.think_markers)
    return Rebuilder(tokenizer, tokens, parsing.chat_template_kwargs, parsing.verify_token_ids)


def sample_of(row: dict[str, Any], parsing: Parsing, rebuilder: Rebuilder | None) -> dict[str, Any]:
    """One training sample from one raw reply row (request and response decoded)."""
    messages = row["request"]["messages"]
    c = parse_completion(
        row["response"], expect_reasoning=parsing.expect_reasoning, think_markers=parsing.think_markers
    )
    if rebuilder is not None:
        c = rebuilder.apply(c, messages)
    return {
        "id": row["id"],
        "prompt_id": row["prompt_id"],
        "turn": row["turn"],
        "category": row["category"],
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
    }


def run_synth(
    replies: str,
    responses_out: str,
    errors_out: str,
    quality_out: str,
    parsing: Parsing,
    verifier_dir: str | None = None,
    batch_rows: int = 1024,
) -> None:
    """`verifier_dir` holds the tokenizer and chat template that rebuild (and check) token
    streams; None disables that. Streamed: `batch_rows` samples in memory at a time, whatever
    the number of replies."""
    rebuilder = load_rebuilder(verifier_dir, parsing)
    quality, errors, prompts = Quality(), [], set()
    with parquet_rows(responses_out, SAMPLES, batch_rows) as out:
        for r in iter_replies(replies):
            prompts.add(r["prompt_id"])
            if r["error"] is not None:
                errors.append(
                    {
                        "conversation_id": r["prompt_id"],
                        "turn": r["turn"],
                        "reason": r["error"],
                        "attempts": r["attempts"],
                    }
                )
            if r["response"] is None:
                continue
            sample = sample_of(r, parsing, rebuilder)
            quality.add(sample)
            out.write(sample)
    write_jsonl(errors_out, errors)
    report = quality.report(errors, num_prompts=len(prompts))
    write_json(quality_out, report)
    log.info("synth: %d samples, %d failed conversations; defects %s", quality.samples, len(errors), report["counts"])


SAMPLES = pa.schema(
    [
        ("id", pa.string()),
        ("prompt_id", pa.string()),
        ("turn", pa.int32()),
        ("category", pa.string()),
        ("messages", pa.string()),
        ("reasoning", pa.string()),
        ("content", pa.string()),
        ("finish_reason", pa.string()),
        ("prompt_token_ids", pa.list_(pa.int32())),
        ("completion_token_ids", pa.list_(pa.int32())),
        ("prompt_tokens", pa.int32()),
        ("completion_tokens", pa.int32()),
        ("server_model", pa.string()),
        ("system_fingerprint", pa.string()),
        ("token_source", pa.string()),
        ("defects", pa.list_(pa.string())),
    ]
)
