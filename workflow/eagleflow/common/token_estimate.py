"""One estimate of a conversation's tokens before it is tokenized: for the concurrency floor
(generate: what the longest request holds in the KV cache) and the plan (what the dataset and
the shards will hold). Pure."""

from __future__ import annotations

from typing import Any

# Characters per token: under the ~4 of English text, so that the estimate errs on the long
# side (a KV cache or a disk sized by it is not too small).
CHARS_PER_TOKEN = 3
# The chat template's tokens around each message (role markers, separators).
TEMPLATE_TOKENS_PER_MESSAGE = 16


def text_tokens(text: str) -> int:
    return len(text) // CHARS_PER_TOKEN


def turn_contexts(prompt: dict[str, Any], max_tokens: int) -> list[int]:
    """Tokens of the conversation at the end of each turn's reply: its system prompt, every
    user turn so far and every reply so far, each reply at most `max_tokens` (a turn is two
    messages of template: the user's and the reply's)."""
    system = prompt.get("system")
    context = text_tokens(system) + TEMPLATE_TOKENS_PER_MESSAGE if system else 0
    out = []
    for turn in prompt["turns"]:
        context += text_tokens(turn) + 2 * TEMPLATE_TOKENS_PER_MESSAGE + max_tokens
        out.append(context)
    return out
