"""The generate stage's shell: walk every conversation through the response store, send
only the requests it lacks, and write the raw replies (`replies.parquet`) and what the run
cost (`stats.json`).

Generation runs as `generate.shards` jobs (shard i of n takes the conversations whose id
hashes to i: adding prompts moves none), each with its own server and its own store file
(runtime.response_store); generate/join.py joins their replies into the one `replies.parquet` synth
reads.

A conversation is walked turn by turn: turn k+1's request carries the user turns and the
verifier's replies to turns 1..k. The walk first runs on the store alone; a server is
started (or an endpoint used) only when some request is missing, so a rerun that the store
fully answers starts no server at all.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
from dataclasses import dataclass
from typing import Any

from eagleflow.common.atomic import read_jsonl, write_json
from eagleflow.common.replies import write_replies
from eagleflow.common.requests import history_message, request_payload, samples_with_seed, server_identity
from eagleflow.common.token_estimate import turn_contexts
from eagleflow.runtime.answers import Client, StoreFront, answer, verifier_access
from eagleflow.runtime.client import RequestFailed
from eagleflow.runtime.response_store import ResponseStore, older_stores, shard_store
from eagleflow.runtime.smk import stage
from eagleflow.runtime.spec import ServerConfig, ServerSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Requests:
    """What is asked: the served model name, sampling (incl. extra_body), chat template kwargs."""

    model: str
    sampling: dict[str, Any]
    chat_template_kwargs: dict[str, Any]


@dataclass(frozen=True)
class Shard:
    """Shard `index` of `count`: the conversations whose id hashes to `index`."""

    index: int
    count: int

    @classmethod
    def parse(cls, name: str) -> Shard:
        m = re.fullmatch(r"(\d+)-of-(\d+)", name)
        if not m or not 0 <= int(m.group(1)) < int(m.group(2)):
            raise ValueError(f"{name!r} is not a shard name (<i>-of-<n>, 0 <= i < n)")
        return cls(int(m.group(1)), int(m.group(2)))

    @property
    def name(self) -> str:
        return f"{self.index}-of-{self.count}"

    def takes(self, prompt_id: str) -> bool:
        digest = hashlib.sha256(prompt_id.encode()).digest()
        return int.from_bytes(digest[:8], "big") % self.count == self.index

    def endpoints(self, endpoint: str | list[str] | None) -> str | list[str] | None:
        """The endpoints of `server.endpoint` this shard sends to: every n-th from its own
        index when there are at least as many as shards, else one, shards taking turns."""
        if not isinstance(endpoint, list) or self.count == 1:
            return endpoint
        if len(endpoint) >= self.count:
            return endpoint[self.index :: self.count]
        return endpoint[self.index % len(endpoint)]


ONE = Shard(0, 1)


def main(smk) -> None:
    """The generate rule's job, one shard (workflow/rules/generate.smk)."""
    with stage(smk):
        server, client = verifier_access(smk.config)
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
            shard=Shard.parse(smk.wildcards.part),
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
    shard: Shard = ONE,
) -> None:
    """The flags of the server as launched that can change a reply go into every store key
    (a `server.endpoint` is taken to run with the flags a launch would give it); when a request
    is missing, `server.endpoint` answers it, or a vLLM launched as `server` says. `shard`:
    only its conversations, its own store file beside `store_path` (runtime.response_store)."""
    prompts = [p for p in read_jsonl(prompts_path) if shard.takes(p["id"])]
    server = dataclasses.replace(server, endpoint=shard.endpoints(server.endpoint))
    spec = ServerSpec.from_config(server, verifier_dir, seeded_sampling=samples_with_seed(requests.sampling))
    own = shard_store(store_path, shard.index, shard.count)
    older = older_stores(store_path, shard.count)
    identity = server_identity(verifier_dir, spec.command(0), spec.env)
    # What every store key of this job holds besides the request: a rerun whose replies miss the
    # store can be compared line by line.
    log.info("server identity of the store keys: %s", json.dumps(identity, sort_keys=True))
    with ResponseStore(own, client.store_locking, older=older) as store:
        entries_before = len(store)
        answered = answer(
            prompts,
            lambda p: p["id"],
            lambda prompt, front: walk_conversation(prompt, requests, front),
            store=store,
            identity=identity,
            spec=spec,
            server=server,
            server_log=server_log,
            client=client,
            request_tokens=longest_request_tokens(prompts, requests.sampling.get("max_tokens")),
            desc="generate" if shard.count == 1 else f"generate {shard.name}",
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
        adopted = store.adopted
    write_replies(replies_out, rows)
    stats = {
        "shard": shard.name,
        "conversations": len(prompts),
        "requests": len(rows),
        **answered.stats(server),
        "failed_conversations": counts.failed,
        "store": str(own),
        "store_entries": len(keys),
        "store_entries_unused": unused,
        "store_entries_adopted": adopted,
        "wall_s": answered.wall_s,
    }
    write_json(stats_out, stats)
    log.info(
        "generate: %d requests, %d sent to the server, %d reused from the store, %d failed conversations; "
        "%d store entries this job's requests do not use (write_prompts' among them; prune: "
        "python -m eagleflow.generate prune)",
        len(rows),
        counts.sent,
        counts.reused,
        counts.failed,
        unused,
    )
