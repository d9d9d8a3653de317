"""Answer a stage's requests from the response store first and a server second.

Every item (a conversation) is walked twice at most: once on the store alone, which answers
whatever it holds, and, only if some item needs a request the store lacks, once more against
a server (launched, or `server.endpoint`), storing each reply durably as it arrives. A rerun
that the store fully answers starts no server. The walk itself (what is asked, in which
order) belongs to the stage; this module only decides where an answer comes from.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from tqdm import tqdm

from eagleflow.common.config import typed
from eagleflow.common.requests import request_key
from eagleflow.runtime.client import ChatClient, RetryPolicy
from eagleflow.runtime.concurrency import Concurrency, parse_ceiling
from eagleflow.runtime.generate_config import GenerateConfig
from eagleflow.runtime.response_store import ResponseStore
from eagleflow.runtime.serving import serve
from eagleflow.runtime.spec import ServerConfig, ServerSpec

T = TypeVar("T")


class Missing(Exception):
    """A request the store does not hold (raised on the store-only walk)."""


@dataclass
class Counts:
    sent: int = 0
    reused: int = 0
    failed: int = 0  # items a failed request ended
    sent_tokens: int = 0  # completion tokens of the replies the server sent


@dataclass(frozen=True)
class Client:
    """How requests are sent and their replies kept: these change speed and robustness, never
    a reply. `concurrency` is the ceiling of an adaptive limit (runtime.concurrency), or the
    fixed number of requests in flight without `adaptive`; `store_locking` how the response
    store is opened (runtime.response_store)."""

    concurrency: int | str
    adaptive: bool
    request_timeout_s: float
    max_attempts: int
    api_key_env: str | None
    store_locking: str

    @classmethod
    def of(cls, generate: GenerateConfig, server: ServerConfig) -> Client:
        """From the `generate` section (and the server's API key variable). Read from the
        config, never params: changing how requests are sent must not rerun a rule."""
        return cls(
            generate.concurrency,
            generate.adaptive_concurrency,
            generate.request_timeout_s,
            generate.max_attempts,
            server.api_key_env,
            generate.store_locking,
        )


def verifier_access(config: dict[str, Any]) -> tuple[ServerConfig, Client]:
    """How a job that asks the verifier (generate, write_prompts) reaches it and sends its
    requests: the `server` section, and the client settings of the `generate` section."""
    server = ServerConfig.from_section(config["server"])
    return server, Client.of(typed(GenerateConfig, config["generate"], "generate"), server)


class StoreFront:
    """The store in front of the server: `ask` answers a request from the store, else from
    the server (storing the reply before returning it), else raises Missing (no server)."""

    def __init__(self, store: ResponseStore, identity: dict[str, Any], counts: Counts, client: ChatClient | None):
        self.store, self.identity, self.counts, self.client = store, identity, counts, client

    def key(self, payload: dict[str, Any]) -> str:
        return request_key(payload, self.identity)

    async def ask(self, payload: dict[str, Any], *, completion: bool = False) -> dict[str, Any]:
        """The reply to `payload` (/v1/completions with `completion`, else chat). Raises the
        client's RequestFailed when the server cannot answer it."""
        key = self.key(payload)
        body = self.store.get(key)
        if body is not None:
            self.counts.reused += 1
            return body
        if self.client is None:
            raise Missing
        body = await (self.client.completion if completion else self.client.chat)(payload)
        self.store.put(key, payload, body)
        self.counts.sent += 1
        tokens = (body.get("usage") or {}).get("completion_tokens")
        self.counts.sent_tokens += tokens if isinstance(tokens, int) else 0
        return body


Walk = Callable[[Any, StoreFront], Awaitable[T]]


@dataclass
class Answered(Generic[T]):
    """What `answer` did: every item's walk result by id, and what it cost."""

    done: dict[str, T]
    counts: Counts
    needed_server: int  # items the store alone could not answer
    restarts: int = 0
    limit: Concurrency | None = None
    wall_s: float = field(default=0.0)
    server_s: float = field(default=0.0)  # from the server ready (or the endpoint first used) to the last reply

    def stats(self, server: ServerConfig) -> dict[str, Any]:
        return {
            "sent": self.counts.sent,
            "reused": self.counts.reused,
            # The rate the plan turns into hours (python -m eagleflow.plan).
            "sent_tokens": self.counts.sent_tokens,
            "server_s": round(self.server_s, 3),
            "server_started": bool(self.needed_server) and not server.endpoint,
            "server_restarts": self.restarts,
            "concurrency": self.limit.summary() if self.limit else None,
        }


def answer(
    items: Sequence[Any],
    item_id: Callable[[Any], str],
    walk: Walk,
    *,
    store: ResponseStore,
    identity: dict[str, Any],
    spec: ServerSpec,
    server: ServerConfig,
    server_log: str,
    client: Client,
    request_tokens: int | None,
    desc: str,
    completion_tokens: Callable[[T], int] = lambda result: 0,
    count_failed: Callable[[T], bool] = lambda result: False,
) -> Answered[T]:
    """Walk every item, on the store first and then, for the items it cannot answer, against
    the server the `server` section names (`spec` launched, or its endpoint)."""
    started = time.monotonic()
    counts = Counts()
    done, todo = asyncio.run(_from_store(items, item_id, walk, store, identity, counts))
    # What older stores held is in this one now (sharded generation): the server pass reads only it.
    store.close_older()
    limit = Concurrency(parse_ceiling(client.concurrency), client.adaptive, name=desc, request_tokens=request_tokens)
    answered = Answered(done, counts, len(todo), limit=limit)
    if todo:
        with serve(spec, server_log, server, server.endpoint) as served:
            ready = time.monotonic()
            parts = (store, identity, counts)
            tokens = completion_tokens
            results = asyncio.run(_from_server(served, todo, item_id, walk, parts, client, limit, desc, tokens))
            answered.restarts = served.recovery.restarts
            answered.server_s = time.monotonic() - ready
        done |= results
    counts.failed = sum(1 for result in done.values() if count_failed(result))
    answered.wall_s = round(time.monotonic() - started, 3)
    return answered


async def _from_store(items, item_id, walk, store, identity, counts: Counts) -> tuple[dict[str, Any], list]:
    done, todo = {}, []
    for item in items:
        # Only a fully answered item's stored replies count here; the server pass walks the rest again.
        store_only = StoreFront(store, identity, Counts(), None)
        try:
            done[item_id(item)] = await walk(item, store_only)
            counts.reused += store_only.counts.reused
        except Missing:
            todo.append(item)
    return done, todo


async def _from_server(served, todo, item_id, walk, front_parts, client_cfg: Client, limit, desc, tokens_of):
    store, identity, counts = front_parts
    done: dict[str, Any] = {}
    bar = tqdm(total=len(todo), desc=desc, unit="conv", mininterval=2.0)
    started, tokens = time.monotonic(), 0
    async with ChatClient(
        served.url,
        concurrency=limit.ceiling,
        request_timeout_s=client_cfg.request_timeout_s,
        retry=RetryPolicy(max_attempts=client_cfg.max_attempts),
        api_key_env=client_cfg.api_key_env,
        limit=limit,
        recovery=served.recovery,
    ) as chat_client:
        front = StoreFront(store, identity, counts, chat_client)

        async def one(item):
            nonlocal tokens
            result = await walk(item, front)
            done[item_id(item)] = result
            tokens += tokens_of(result)
            bar.set_postfix(
                sent=counts.sent,
                reused=counts.reused,
                tok_s=f"{tokens / (time.monotonic() - started):.0f}",
                in_flight=f"{limit.in_flight}/{limit.current}",
                refresh=False,
            )
            bar.update()

        # Every item is a task; the limit admits their requests (turn by turn).
        await asyncio.gather(*(one(item) for item in todo))
    bar.close()
    return done
