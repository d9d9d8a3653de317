"""The generate stage's shell: walk every conversation through the response store, send
only the requests it lacks, and write the raw replies (`replies.parquet`) and what the run
cost (`stats.json`).

A conversation is walked turn by turn: turn k+1's request carries the user turns and the
verifier's replies to turns 1..k. The walk first runs on the store alone; a server is
started (or an endpoint used) only when some request is missing, so a rerun that the store
fully answers starts no server at all.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from workflow_scripts.common.atomic import read_jsonl, write_json
from workflow_scripts.common.replies import write_replies
from workflow_scripts.common.requests import history_message, request_payload, server_identity
from workflow_scripts.common.token_estimate import turn_contexts
from workflow_scripts.runtime.answering import Client, StoreFront, answer
from workflow_scripts.runtime.client import RequestFailed
from workflow_scripts.runtime.smk import stage
from workflow_scripts.runtime.spec import ServerConfig, ServerSpec
from workflow_scripts.runtime.store import ResponseStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Requests:
    """What is asked: the served model name, sampling (incl. extra_body), chat template kwargs."""

    model: str
    sampling: dict[str, Any]
    chat_template_kwargs: dict[str, Any]


def main(smk) -> None:
    """The generate rule's job (rules/generate.smk)."""
    with stage(smk):
        server = ServerConfig.from_section(smk.config["server"])
        run_generate(
            smk.input.prompts,
            smk.input.verifier,
            smk.params.store,
            smk.output.replies,
            smk.output.stats,
            requests=Requests(**smk.params.requests),
            client=Client.of(smk.config["generate"], server),
            server=server,
            server_log=smk.log.vllm,
        )


async def walk_conversation(prompt: dict[str, Any], requests: Requests, front: StoreFront) -> list[dict[str, Any]]:
    """One row per assistant turn (request, reply body, store key), in order. A failed request
    ends the conversation with an error row; the store-only walk's Missing propagates."""
    messages: list[dict[str, Any]] = []
    if prompt.get("system"):
        messages.append({"role": "system", "content": prompt["system"]})
    rows = []
    for turn, user_text in enumerate(prompt["turns"]):
        messages = [*messages, {"role": "user", "content": user_text}]
        payload = request_payload(
            messages,
            prompt["id"],
            turn,
            model=requests.model,
            sampling=requests.sampling,
            chat_template_kwargs=requests.chat_template_kwargs,
        )
        row = {
            "id": f"{prompt['id']}#t{turn}",
            "prompt_id": prompt["id"],
            "turn": turn,
            "category": prompt.get("category"),
            "key": front.key(payload),
            "request": payload,
            "response": None,
            "error": None,
            "attempts": None,
        }
        try:
            body = await front.ask(payload)
        except RequestFailed as exc:
            rows.append({**row, "error": exc.reason, "attempts": exc.attempts})
            return rows
        rows.append({**row, "response": body})
        messages = [*messages, history_message(body)]
    return rows


def longest_request_tokens(conversations: list[dict[str, Any]], max_tokens: int | None) -> int | None:
    """An upper estimate of the tokens the longest request of `conversations` holds in the
    server's KV cache at its end (common.token_estimate): its system prompt and user turns,
    the replies to its earlier turns and its own, each at most `max_tokens`. None without a
    max_tokens. Pure."""
    if not max_tokens or not conversations:
        return None
    return max(turn_contexts(p, max_tokens)[-1] for p in conversations)


def run_generate(
    prompts_path: str,
    verifier_dir: str,
    store_path: str,
    replies_out: str,
    stats_out: str,
    *,
    requests: Requests,
    client: Client,
    server: ServerConfig,
    server_log: str,
) -> None:
    """The flags of the server as launched that can change a reply go into every store key
    (a `server.endpoint` is taken to run with the flags a launch would give it); when a request
    is missing, `server.endpoint` answers it, or a vLLM launched as `server` says."""
    prompts = read_jsonl(prompts_path)
    spec = ServerSpec.from_config(server, verifier_dir)
    with ResponseStore(store_path, client.store_locking) as store:
        entries_before = len(store)
        answered = answer(
            prompts,
            lambda p: p["id"],
            lambda prompt, front: walk_conversation(prompt, requests, front),
            store=store,
            identity=server_identity(verifier_dir, spec.command(0)),
            spec=spec,
            server=server,
            server_log=server_log,
            client=client,
            request_tokens=longest_request_tokens(prompts, requests.sampling.get("max_tokens")),
            desc="generate",
            completion_tokens=lambda rows: sum(
                ((r["response"] or {}).get("usage") or {}).get("completion_tokens") or 0 for r in rows
            ),
            count_failed=lambda rows: rows[-1]["error"] is not None,
        )
        log.info(
            "%d of %d conversations answered by the store %s (%d entries before this job)",
            len(prompts) - answered.needed_server,
            len(prompts),
            store_path,
            entries_before,
        )
        rows = [row for p in prompts for row in answered.done[p["id"]]]
        keys = store.keys()
        unused = len(keys - {r["key"] for r in rows})
        counts = answered.counts
    write_replies(replies_out, rows)
    stats = {
        "conversations": len(prompts),
        "requests": len(rows),
        **answered.stats(server),
        "failed_conversations": counts.failed,
        "store": str(store_path),
        "store_entries": len(keys),
        "store_entries_unused": unused,
        "wall_s": answered.wall_s,
    }
    write_json(stats_out, stats)
    log.info(
        "generate: %d requests, %d sent to the server, %d reused from the store, %d failed conversations; "
        "%d store entries this job's requests do not use (write_prompts' among them; prune: "
        "python -m workflow_scripts.generate prune)",
        len(rows),
        counts.sent,
        counts.reused,
        counts.failed,
        unused,
    )
