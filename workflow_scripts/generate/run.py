"""The generate stage's shell: walk every conversation through the response store, send
only the requests it lacks, and write the raw replies (`replies.parquet`) and what the run
cost (`stats.json`).

A conversation is walked turn by turn: turn k+1's request carries the user turns and the
verifier's replies to turns 1..k. The walk first runs on the store alone; a server is
started (or an endpoint used) only when some request is missing, so a rerun that the store
fully answers starts no server at all.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from workflow_scripts.common.atomic import read_jsonl, write_json
from workflow_scripts.common.replies import write_replies
from workflow_scripts.common.token_estimate import turn_contexts
from workflow_scripts.generate.requests import history_message, request_key, request_payload, server_identity
from workflow_scripts.generate.store import ResponseStore
from workflow_scripts.runtime.client import ChatClient, RequestFailed, RetryPolicy
from workflow_scripts.runtime.concurrency import Concurrency, parse_ceiling
from workflow_scripts.runtime.serving import Served, serve
from workflow_scripts.runtime.smk import stage
from workflow_scripts.runtime.spec import ServerConfig, ServerSpec

log = logging.getLogger(__name__)

Send = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


@dataclass(frozen=True)
class Requests:
    """What is asked: the served model name, sampling (incl. extra_body), chat template kwargs."""

    model: str
    sampling: dict[str, Any]
    chat_template_kwargs: dict[str, Any]


@dataclass(frozen=True)
class Client:
    """How it is asked: these change speed and robustness, never a reply. `concurrency` is
    the ceiling of an adaptive limit (runtime.concurrency), or the fixed number of requests
    in flight without `adaptive`."""

    concurrency: int | str
    adaptive: bool
    request_timeout_s: float
    max_attempts: int
    api_key_env: str | None


def main(smk) -> None:
    """The generate rule's job (rules/generate.smk)."""
    with stage(smk):
        server = ServerConfig.from_section(smk.config["server"])
        generate = smk.config["generate"]
        # Operational settings come from the config, not params: changing them must not rerun the rule.
        client = Client(
            generate["concurrency"],
            generate["adaptive_concurrency"],
            generate["request_timeout_s"],
            generate["max_attempts"],
            server.api_key_env,
        )
        run_generate(
            smk.input.prompts,
            smk.input.verifier,
            smk.params.store,
            smk.output.replies,
            smk.output.stats,
            requests=Requests(**smk.params.requests),
            client=client,
            server=server,
            server_log=smk.log.vllm,
        )


class Missing(Exception):
    """A request the store does not hold (raised by the store-only walk)."""


@dataclass
class Counts:
    sent: int = 0
    reused: int = 0
    failed_conversations: int = 0


async def walk_conversation(
    prompt: dict[str, Any],
    requests: Requests,
    identity: dict[str, Any],
    store: ResponseStore,
    send: Send,
    counts: Counts,
) -> list[dict[str, Any]]:
    """One row per assistant turn (request, reply body, store key), in order. A failed request
    ends the conversation with an error row; `Missing` from `send` propagates."""
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
        key = request_key(payload, identity)
        row = {
            "id": f"{prompt['id']}#t{turn}",
            "prompt_id": prompt["id"],
            "turn": turn,
            "category": prompt.get("category"),
            "key": key,
            "request": payload,
            "response": None,
            "error": None,
            "attempts": None,
        }
        body = store.get(key)
        if body is None:
            try:
                body = await send(payload)
            except RequestFailed as exc:
                counts.failed_conversations += 1
                rows.append({**row, "error": exc.reason, "attempts": exc.attempts})
                return rows
            store.put(key, payload, body)
            counts.sent += 1
        else:
            counts.reused += 1
        rows.append({**row, "response": body})
        messages = [*messages, history_message(body)]
    return rows


async def _from_store(prompts, requests, identity, store) -> tuple[dict[str, list], list[dict]]:
    async def missing(payload):
        raise Missing

    done, todo = {}, []
    for p in prompts:
        try:
            done[p["id"]] = await walk_conversation(p, requests, identity, store, missing, Counts())
        except Missing:
            todo.append(p)
    return done, todo


async def _from_server(
    served: Served, todo, requests, identity, store, client_cfg: Client, counts: Counts, limit: Concurrency
) -> dict[str, list]:
    done: dict[str, list] = {}
    bar = tqdm(total=len(todo), desc="generate", unit="conv", mininterval=2.0)
    started, tokens = time.monotonic(), 0
    async with ChatClient(
        served.url,
        concurrency=limit.ceiling,
        request_timeout_s=client_cfg.request_timeout_s,
        retry=RetryPolicy(max_attempts=client_cfg.max_attempts),
        api_key_env=client_cfg.api_key_env,
        limit=limit,
        recovery=served.recovery,
    ) as client:

        async def one(prompt):
            nonlocal tokens
            rows = await walk_conversation(prompt, requests, identity, store, client.chat, counts)
            done[prompt["id"]] = rows
            tokens += sum(((r["response"] or {}).get("usage") or {}).get("completion_tokens") or 0 for r in rows)
            elapsed = time.monotonic() - started
            bar.set_postfix(
                sent=counts.sent,
                reused=counts.reused,
                tok_s=f"{tokens / elapsed:.0f}",
                in_flight=f"{limit.in_flight}/{limit.current}",
                failed=counts.failed_conversations,
                refresh=False,
            )
            bar.update()

        # Every conversation is a task; the limit admits their requests (turn by turn).
        await asyncio.gather(*(one(p) for p in todo))
    bar.close()
    return done


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
    started = time.monotonic()
    prompts = read_jsonl(prompts_path)
    spec = ServerSpec.from_config(server, verifier_dir)
    identity = server_identity(verifier_dir, spec.command(0))
    with ResponseStore(store_path) as store:
        entries_before = len(store)
        done, todo = asyncio.run(_from_store(prompts, requests, identity, store))
        counts = Counts(reused=sum(len(rows) for rows in done.values()))
        log.info(
            "%d of %d conversations answered by the store %s (%d entries); %d need the server",
            len(done),
            len(prompts),
            store_path,
            entries_before,
            len(todo),
        )
        limit = Concurrency(
            parse_ceiling(client.concurrency),
            client.adaptive,
            name="generate",
            request_tokens=longest_request_tokens(todo, requests.sampling.get("max_tokens")),
        )
        restarts = 0
        if todo:
            with serve(spec, server_log, server, server.endpoint) as served:
                done |= asyncio.run(_from_server(served, todo, requests, identity, store, client, counts, limit))
                restarts = served.recovery.restarts
        rows = [row for p in prompts for row in done[p["id"]]]
        keys = store.keys()
        unused = len(keys - {r["key"] for r in rows})
    write_replies(replies_out, rows)
    stats = {
        "conversations": len(prompts),
        "requests": len(rows),
        "sent": counts.sent,
        "reused": counts.reused,
        "failed_conversations": counts.failed_conversations,
        "server_started": bool(todo) and not server.endpoint,
        "store": str(store_path),
        "store_entries": len(keys),
        "store_entries_unused": unused,
        "server_restarts": restarts,
        "concurrency": limit.summary(),
        "wall_s": round(time.monotonic() - started, 3),
    }
    write_json(stats_out, stats)
    log.info(
        "generate: %d requests, %d sent to the server, %d reused from the store, %d failed conversations; "
        "%d store entries no current request uses (prune: python -m workflow_scripts.generate prune)",
        len(rows),
        counts.sent,
        counts.reused,
        counts.failed_conversations,
        unused,
    )
