"""Pure functions that turn a chat-completion reply into a training sample.

The training sequence of a sample is the verifier's own token stream: the prompt as the
server rendered it (`prompt_token_ids`) followed by the generated tokens
(`choices[0].token_ids`), think markers included as the single tokens they are. Decoded
text is kept for people to read, never re-tokenized for training.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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
    token_source: str = "server"


def reasoning_of(message: dict[str, Any]) -> str | None:
    """The reasoning text, from whichever field the server used (None when it sent neither)."""
    for key in REASONING_FIELDS:
        value = message.get(key)
        if value is not None:
            return value
    return None


def parse_completion(
    body: dict[str, Any], *, expect_reasoning: bool, think_markers: Sequence[str] | None = None
) -> Completion:
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
    completion.defects = defects_of(completion, expect_reasoning=expect_reasoning, think_markers=think_markers)
    return completion


def defects_of(c: Completion, *, expect_reasoning: bool, think_markers: Sequence[str] | None = None) -> list[str]:
    """Defect classes of one sample. Names match the keys of synth/quality.json."""
    defects = []
    if c.prompt_token_ids is None or c.completion_token_ids is None:
        defects.append("missing_token_ids")
    elif (
        c.prompt_tokens is not None
        and c.completion_tokens is not None
        and (len(c.prompt_token_ids) != c.prompt_tokens or len(c.completion_token_ids) != c.completion_tokens)
    ):
        defects.append("token_count_mismatch")
    if not (c.content or "").strip():
        defects.append("empty_content")
    if think_markers and c.content and think_markers[0] in c.content and think_markers[1] not in c.content:
        # The server did not split reasoning off (no reasoning parser) and the think block
        # it left in the content never closed.
        defects.append("unterminated_reasoning")
    elif expect_reasoning:
        if not (c.reasoning or "").strip():
            defects.append("empty_reasoning")
        elif c.content is None and c.finish_reason != "length":
            # Reasoning but no content although generation stopped on its own: the
            # think block was never closed.
            defects.append("unterminated_reasoning")
    if c.finish_reason == "length":
        defects.append("truncated")
    return defects


@dataclass(frozen=True)
class StreamTokens:
    """The special tokens that frame a completion in the verifier's token stream."""

    eos_id: int
    think_start_id: int | None = None
    think_end_id: int | None = None


def stream_tokens(tokenizer, think_markers: Sequence[str] | None) -> StreamTokens:
    """Resolve EOS and think markers; each marker must be exactly one token."""
    think_ids: list[int | None] = [None, None]
    if think_markers:
        for i, marker in enumerate(think_markers):
            ids = tokenizer.encode(marker, add_special_tokens=False)
            if len(ids) != 1:
                raise ValueError(
                    f"synth.think_markers: {marker!r} encodes to {len(ids)} tokens {ids} with the verifier's "
                    f"tokenizer; a think marker must be a single (special) token"
                )
            think_ids[i] = ids[0]
    return StreamTokens(eos_id=tokenizer.eos_token_id, think_start_id=think_ids[0], think_end_id=think_ids[1])


def rebuild_completion_ids(
    encode: Callable[[str], list[int]],
    prompt_ids: Sequence[int],
    reasoning: str | None,
    content: str | None,
    finish_reason: str | None,
    tokens: StreamTokens,
) -> list[int]:
    """The completion's token ids rebuilt from its text fields. Pure given `encode`.

    For servers that cannot return token ids. A thinking verifier's stream is
    [<think>] reasoning </think> content [eos]; the opening marker is absent when the chat
    template already opened the think block in the prompt. Text is re-encoded, so a
    non-canonical tokenization or a special token inside the content makes the rebuild
    differ from what the verifier generated: `verify_stream` catches that.
    """
    ids: list[int] = []
    thinking = tokens.think_end_id is not None
    opened = thinking and bool(prompt_ids) and prompt_ids[-1] == tokens.think_start_id
    if thinking and (reasoning is not None or opened):
        if not opened:
            ids.append(tokens.think_start_id)
        ids += encode(reasoning or "")
        if content is not None or finish_reason == "stop":
            ids.append(tokens.think_end_id)
    ids += encode(content or "")
    if finish_reason == "stop":
        ids.append(tokens.eos_id)
    return ids


def rebuild_prompt_ids(
    tokenizer, messages: list[dict[str, Any]], chat_template_kwargs: dict[str, Any] | None = None
) -> list[int]:
    out = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, **(chat_template_kwargs or {})
    )
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def verify_stream(c: Completion, rebuilt_prompt: list[int], rebuilt_completion: list[int]) -> Completion:
    """Use the rebuilt ids where the server sent none; flag `token_mismatch` where both exist and differ."""
    if c.prompt_token_ids is None or c.completion_token_ids is None:
        c.prompt_token_ids, c.completion_token_ids = rebuilt_prompt, rebuilt_completion
        c.token_source = "rebuilt"
        c.defects = [d for d in c.defects if d not in ("missing_token_ids", "token_count_mismatch")]
    elif (c.prompt_token_ids, c.completion_token_ids) != (rebuilt_prompt, rebuilt_completion):
        c.defects.append("token_mismatch")
    return c
