"""Where a user turn opens and where it ends, in the verifier's own chat template.

An aligned chat model, given its template's text up to the start of a user turn, writes a
plausible user request and ends the turn with the template's end-of-turn token (the
technique the Magpie data sets were made with). Both ends come from rendering the template
around a sentinel message:

- the **opening** for a conversation so far is the rendering of that conversation plus a
  user turn holding the sentinel, cut where the sentinel starts;
- the **end of the turn** is the first token after the sentinel in a rendering that goes on
  to the assistant's turn (`<|im_end|>` in ChatML, `<｜Assistant｜>` in DeepSeek-V3's
  template, which has no end-of-user token of its own). It must be one special token: the
  server stops on a token id, and special tokens never reach a reply's text.

A template is refused, naming the verifier, when the user's text does not appear verbatim
(the template rewrites it), when the opening depends on what the user writes, or when no
single special token ends the turn. Pure: the rendering and the tokenizer are passed in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# Two sentinels with nothing in common: an opening that changes between them depends on the text.
SENTINELS = ("eagleflow-user-turn-4f1c", "Zq9 sentinel XR")

Render = Callable[[list[dict[str, Any]], bool], str]  # (messages, add_generation_prompt) -> text


class TemplateError(ValueError):
    pass


@dataclass(frozen=True)
class UserTurn:
    """How the verifier's template opens and ends a user turn."""

    verifier: str
    render: Render
    end_token_id: int
    end_token: str

    @classmethod
    def find(
        cls,
        verifier: str,
        render: Render,
        encode: Callable[[str], list[int]],
        special_ids: set[int],
        decode: Callable[[list[int]], str],
        system: str | None = None,
    ) -> UserTurn:
        """The user turn of the template `render` renders, checked on a conversation that
        opens with `system` (if any) and on one with an earlier exchange; a TemplateError
        naming `verifier` when the template has no clean user turn."""
        history: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        exchange = [*history, {"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hi."}]
        for before in (history, exchange):
            openings = {_opening(verifier, render, before, s) for s in SENTINELS}
            if len(openings) != 1:
                raise TemplateError(
                    f"verifier {verifier}: its chat template's text before a user turn depends on what the "
                    "user writes; the verifier cannot be asked to write prompts with it (prompts.written)"
                )
        after = _after_sentinel(verifier, render, history)
        ids = encode(after)
        if not ids or ids[0] not in special_ids:
            raise TemplateError(
                f"verifier {verifier}: its chat template ends a user turn with {after[:40]!r}, which does not "
                "begin with a special token; the server could not stop at the end of a written turn "
                "(prompts.written needs a template whose user turns end in one)"
            )
        return cls(verifier, render, ids[0], decode(ids[:1]))

    def opening(self, conversation: Sequence[dict[str, Any]]) -> str:
        """The template's text of `conversation` (system, user and assistant messages) up to
        where the next user turn's text begins."""
        return _opening(self.verifier, self.render, list(conversation), SENTINELS[0])


def _opening(verifier: str, render: Render, before: list[dict[str, Any]], sentinel: str) -> str:
    text = render([*before, {"role": "user", "content": sentinel}], False)
    if text.count(sentinel) != 1:
        raise TemplateError(
            f"verifier {verifier}: its chat template does not render a user's text verbatim once "
            f"(found {text.count(sentinel)} times); the verifier cannot be asked to write prompts with it"
        )
    return text[: text.index(sentinel)]


def _after_sentinel(verifier: str, render: Render, before: list[dict[str, Any]]) -> str:
    sentinel = SENTINELS[0]
    text = render([*before, {"role": "user", "content": sentinel}], True)
    if text.count(sentinel) != 1:
        raise TemplateError(f"verifier {verifier}: its chat template does not render a user's text verbatim once")
    return text[text.index(sentinel) + len(sentinel) :]


def tokenizer_render(tokenizer, chat_template_kwargs: dict[str, Any] | None = None) -> Render:
    """`Render` through a transformers tokenizer's chat template."""

    def render(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **(chat_template_kwargs or {})
        )

    return render


def user_turn_of(tokenizer, verifier: str, system: str | None, chat_template_kwargs=None) -> UserTurn:
    """The user turn of a transformers tokenizer's template."""
    if not getattr(tokenizer, "chat_template", None):
        raise TemplateError(f"verifier {verifier}: its tokenizer has no chat template")
    return UserTurn.find(
        verifier,
        tokenizer_render(tokenizer, chat_template_kwargs),
        lambda text: tokenizer.encode(text, add_special_tokens=False),
        set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special},
        lambda ids: tokenizer.decode(ids),
        system,
    )
