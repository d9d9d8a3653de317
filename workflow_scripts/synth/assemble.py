"""Pure functions that turn a chat-completion reply into a training sample.

The training sequence of a sample is the verifier's own token stream: the prompt as the
server rendered it (`prompt_token_ids`) followed by the generated tokens
(`choices[0].token_ids`), think markers included as the single tokens they are. Decoded
text is kept for people to read, never re-tokenized for training.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# vLLM >= 0.16 sends `reasoning`; older vLLM and SGLang send `reasoning_content`.
REASONING_FIELDS = ("reasoning", "reasoning_content")


@dataclass
class Completion:
    reasoning: str | None
    content: str | None
    finish_reason: str | None
    prompt_token_ids: list[int] | None
    completion_token_ids: list[int] | None
    prompt_tokens: int | None
    completion_tokens: int | None
    server_model: str | None
    system_fingerprint: str | None
    defects: list[str] = field(default_factory=list)


def reasoning_of(message: dict[str, Any]) -> str | None:
    """The reasoning text, from whichever field the server used (None when it sent neither)."""
    for key in REASONING_FIELDS:
        value = message.get(key)
        if value is not None:
            return value
    return None


def parse_completion(body: dict[str, Any], *, expect_reasoning: bool) -> Completion:
    """Extract one sample from a /v1/chat/completions body and list its defects."""
    choice = body["choices"][0]
    message = choice.get("message") or {}
    usage = body.get("usage") or {}
    completion = Completion(
        reasoning=reasoning_of(message),
        content=message.get("content"),
        finish_reason=choice.get("finish_reason"),
        prompt_token_ids=body.get("prompt_token_ids"),
        completion_token_ids=choice.get("token_ids"),
        prompt_tokens=usage.get("prompt_tokens"),
        completion_tokens=usage.get("completion_tokens"),
        server_model=body.get("model"),
        system_fingerprint=body.get("system_fingerprint"),
    )
    completion.defects = defects_of(completion, expect_reasoning=expect_reasoning)
    return completion


def defects_of(c: Completion, *, expect_reasoning: bool) -> list[str]:
    """Defect classes of one sample. Names match the keys of synth/quality.json."""
    defects = []
    if c.prompt_token_ids is None or c.completion_token_ids is None:
        defects.append("missing_token_ids")
    elif c.prompt_tokens is not None and c.completion_tokens is not None and (
        len(c.prompt_token_ids) != c.prompt_tokens or len(c.completion_token_ids) != c.completion_tokens
    ):
        defects.append("token_count_mismatch")
    if not (c.content or "").strip():
        defects.append("empty_content")
    if expect_reasoning:
        if not (c.reasoning or "").strip():
            defects.append("empty_reasoning")
        elif c.content is None and c.finish_reason != "length":
            # Reasoning but no content although generation stopped on its own: the
            # think block was never closed.
            defects.append("unterminated_reasoning")
    if c.finish_reason == "length":
        defects.append("truncated")
    return defects


def sequence_of(prompt_token_ids: list[int], completion_token_ids: list[int], max_len: int | None = None) -> tuple[list[int], list[int]]:
    """input_ids and loss_mask (1 on verifier-generated tokens) of one sample, cut to max_len."""
    input_ids = list(prompt_token_ids) + list(completion_token_ids)
    loss_mask = [0] * len(prompt_token_ids) + [1] * len(completion_token_ids)
    if max_len is not None:
        input_ids, loss_mask = input_ids[:max_len], loss_mask[:max_len]
    return input_ids, loss_mask
