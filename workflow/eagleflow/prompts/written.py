"""Prompts the verifier writes itself (the write_prompts rule): given only its chat template's
text up to the start of a user turn, an aligned chat model writes a plausible user request
and ends the turn (the technique the Magpie data sets were made with). On the production host
the prompts are then in the verifier's own distribution, which is what its draft must predict,
and no prompt data set has to be found, downloaded or license-checked.

Conversation i (id `w<seed>-<i>`) is written turn by turn. Its first user turn is sampled
after the template's opening (with `hints`, a system prompt naming conversation i's hint is
in the writing context only). For a later turn the verifier first answers the conversation so
far, with exactly the request generate will send for it (so generate reuses that reply from
the store), and then writes the next user turn after it. A turn that hits `max_tokens`
before its end-of-turn token ends the conversation there, marked as not ended (the prompts
rule's filters drop it).

Every request goes through the response store: a rerun sends nothing, and asking for more
conversations sends only the new ones' requests.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from eagleflow.common.atomic import write_json, write_jsonl
from eagleflow.common.config import typed
from eagleflow.common.requests import (
    history_message,
    request_payload,
    sample_seed,
    samples_with_seed,
    server_identity,
)
from eagleflow.prompts.config import WrittenConfig
from eagleflow.prompts.template import UserTurn, user_turn_of
from eagleflow.runtime.answers import Client, StoreFront, answer, verifier_access
from eagleflow.runtime.client import RequestFailed
from eagleflow.runtime.response_store import ResponseStore
from eagleflow.runtime.smk import stage
from eagleflow.runtime.spec import ServerConfig, ServerSpec

log = logging.getLogger(__name__)

SOURCE = "written"


@dataclass(frozen=True)
class Replies:
    """How the verifier answers a written turn (generate's requests: the model, sampling and
    chat template kwargs), needed for conversations of more than one turn."""

    model: str
    sampling: dict[str, Any]
    chat_template_kwargs: dict[str, Any]


def conversation_id(seed: int, index: int) -> str:
    return f"w{seed}-{index:06d}"


def completion_payload(
    prompt_ids: list[int], conversation: str, turn: int, *, model: str, cfg: WrittenConfig, end_token_id: int
) -> dict[str, Any]:
    """The /v1/completions body that asks for one user turn: the template's opening as token
    ids (exact, where text would be tokenized again), stopped at the end-of-turn token. Pure."""
    return {
        "model": model,
        "prompt": prompt_ids,
        "max_tokens": cfg.max_tokens,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "seed": sample_seed(cfg.seed, conversation, turn),
        "stop_token_ids": [end_token_id],
    }


def writing_context(cfg: WrittenConfig, index: int) -> tuple[str | None, list[dict[str, Any]]]:
    """(the hint, the messages before the first user turn while writing): the hint's system
    prompt if there are hints, else the conversation's own system prompt. Pure."""
    if cfg.hints:
        hint = cfg.hints[index % len(cfg.hints)]
        return hint, [{"role": "system", "content": cfg.hint_prompt.format(hint=hint)}]
    return None, ([{"role": "system", "content": cfg.system}] if cfg.system else [])


async def write_conversation(
    index: int,
    cfg: WrittenConfig,
    user_turn: UserTurn,
    encode,
    model: str,
    replies: Replies | None,
    front: StoreFront,
) -> dict[str, Any]:
    """Conversation `index`: its user turns as written, whether each ended, the store keys of
    its requests, and the error that ended it, if any."""
    conversation = conversation_id(cfg.seed, index)
    hint, writing = writing_context(cfg, index)
    kept: list[dict[str, Any]] = [{"role": "system", "content": cfg.system}] if cfg.system else []
    row: dict[str, Any] = {
        "id": conversation,
        "category": hint or SOURCE,
        "system": cfg.system,
        "turns": [],
        "ended": [],
        "keys": [],
        "error": None,
    }
    try:
        for turn in range(cfg.turns):
            if turn:
                # generate's own request for the reply to the turn before: it finds it in the store.
                payload = request_payload(
                    kept,
                    conversation,
                    turn - 1,
                    model=replies.model,
                    sampling=replies.sampling,
                    chat_template_kwargs=replies.chat_template_kwargs,
                )
                row["keys"].append(front.key(payload))
                reply = history_message(await front.ask(payload))
                kept, writing = [*kept, reply], [*writing, reply]
            payload = completion_payload(
                encode(user_turn.opening(writing)),
                conversation,
                turn,
                model=model,
                cfg=cfg,
                end_token_id=user_turn.end_token_id,
            )
            row["keys"].append(front.key(payload))
            choice = (await front.ask(payload, completion=True))["choices"][0]
            text, ended = (choice.get("text") or "").strip(), choice.get("finish_reason") == "stop"
            row["turns"].append(text)
            row["ended"].append(ended)
            if not ended or not text:
                break
            message = {"role": "user", "content": text}
            kept, writing = [*kept, message], [*writing, message]
    except RequestFailed as exc:
        row["error"] = exc.reason
    return row


def longest_request_tokens(cfg: WrittenConfig, replies: Replies | None) -> int:
    """An upper estimate of a conversation's last request: each written turn and each reply
    at their max_tokens, and the template's text around them. Pure."""
    reply = replies.sampling.get("max_tokens", 0) if replies else 0
    return cfg.turns * (cfg.max_tokens + reply) + 256


def main(smk) -> None:
    """The write_prompts rule's job (workflow/rules/prompts.smk)."""
    with stage(smk):
        server, client = verifier_access(smk.config)
        run_write_prompts(
            smk.input.verifier,
            smk.params.store,
            smk.output.written,
            smk.output.stats,
            cfg=typed(WrittenConfig, smk.params.written, "prompts.written"),
            model=smk.params.model,
            replies=Replies(**smk.params.replies) if smk.params.replies else None,
            chat_template_kwargs=smk.params.chat_template_kwargs,
            trust_remote_code=smk.params.trust_remote_code,
            client=client,
            server=server,
            server_log=smk.log.vllm,
        )


def run_write_prompts(
    verifier_dir: str,
    store_path: str,
    written_out: str,
    stats_out: str,
    *,
    cfg: WrittenConfig,
    model: str,
    replies: Replies | None,
    chat_template_kwargs: dict[str, Any],
    trust_remote_code: bool,
    client: Client,
    server: ServerConfig,
    server_log: str,
) -> None:
    from transformers import AutoTokenizer

    if cfg.turns > 1 and replies is None:
        raise ValueError("prompts.written.turns > 1 needs generate's requests for the verifier's replies")
    tokenizer = AutoTokenizer.from_pretrained(verifier_dir, trust_remote_code=trust_remote_code)
    writing_system = cfg.hint_prompt.format(hint="x") if cfg.hints else cfg.system
    user_turn = user_turn_of(tokenizer, verifier_dir, writing_system, chat_template_kwargs)

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    # Written turns are sampled with a seed each (completion_payload); replies may be too.
    seeded = cfg.temperature > 0 or (replies is not None and samples_with_seed(replies.sampling))
    spec = ServerSpec.from_config(server, verifier_dir, seeded_sampling=seeded)
    with ResponseStore(store_path, client.store_locking) as store:
        answered = answer(
            list(range(cfg.count)),
            str,
            lambda index, front: write_conversation(index, cfg, user_turn, encode, model, replies, front),
            store=store,
            identity=server_identity(verifier_dir, spec.command(0), spec.env),
            spec=spec,
            server=server,
            server_log=server_log,
            client=client,
            request_tokens=longest_request_tokens(cfg, replies),
            desc="write prompts",
            count_failed=lambda row: row["error"] is not None,
        )
    rows = [{**answered.done[str(i)], "source": SOURCE} for i in range(cfg.count)]
    write_jsonl(written_out, rows)
    stats = {
        "conversations": len(rows),
        "ended": sum(1 for r in rows if r["ended"] and all(r["ended"]) and len(r["turns"]) == cfg.turns),
        "failed": answered.counts.failed,
        "end_of_turn_token": user_turn.end_token,
        **answered.stats(server),
        "wall_s": answered.wall_s,
    }
    write_json(stats_out, stats)
    log.info(
        "write_prompts: %d conversations (%d with every turn ended), %d requests sent, %d reused from the store %s",
        len(rows),
        stats["ended"],
        stats["sent"],
        stats["reused"],
        store_path,
    )
