"""The response store's replies in a bucket, one object each, as runtime.response_store's docstring
says: published as each is stored, fetched into a job's local copy when it opens the store.

An object holds the reply as the store's row does (the packed request and response, and when
it was stored), and its sha256 in the object's metadata: a reply that does not match it is
refused with its URL, never answered from.

Run-only: where replies lie, never what they are.
"""

from __future__ import annotations

import hashlib
import struct
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from eagleflow.runtime.object_store import DIGEST, Bucket, ObjectStoreError, check_access, client

if TYPE_CHECKING:
    from eagleflow.runtime.response_store import ResponseStore

HEADER = struct.Struct("<dI")  # created, length of the packed request
PREFIX = "replies/"
THREADS = 32


def reply_path(key: str) -> str:
    return f"{PREFIX}{key[:2]}/{key}"


def pack_reply(request: bytes, response: bytes, created: float) -> bytes:
    return HEADER.pack(created, len(request)) + request + response


def unpack_reply(body: bytes) -> tuple[bytes, bytes, float]:
    created, n = HEADER.unpack_from(body)
    start = HEADER.size
    return body[start : start + n], body[start + n :], created


class ReplyBucket:
    """The replies under `s3://bucket/prefix/replies/` (checked reachable when made)."""

    def __init__(self, url: str):
        check_access(url)
        self.bucket = Bucket(url)

    def publish(self, key: str, request: bytes, response: bytes, created: float) -> None:
        """Put one reply (whole or not at all: a single PUT)."""
        body = pack_reply(request, response, created)
        where = self.bucket.where
        self.bucket._call(
            lambda: client().put_object(
                Bucket=where.bucket,
                Key=where.key(reply_path(key)),
                Body=body,
                Metadata={DIGEST: hashlib.sha256(body).hexdigest()},
            ),
            reply_path(key),
        )

    def fetch(self, key: str) -> tuple[bytes, bytes, float]:
        where = self.bucket.where
        got = self.bucket._call(
            lambda: client().get_object(Bucket=where.bucket, Key=where.key(reply_path(key))), reply_path(key)
        )
        body = got["Body"].read()
        if hashlib.sha256(body).hexdigest() != got.get("Metadata", {}).get(DIGEST):
            raise ObjectStoreError(
                f"{where.url(reply_path(key))}: the reply does not match the digest it was stored with (changed "
                "after it was written): delete it, and the request is sent again"
            )
        return unpack_reply(body)

    def keys(self) -> set[str]:
        return {rel.rsplit("/", 1)[-1] for rel, _ in self.bucket.listing(PREFIX)}

    def sync(self, store: ResponseStore) -> tuple[int, int]:
        """Fetch into `store` (its local copy) the replies it lacks, and publish those the bucket
        lacks. Returns (fetched, published)."""
        remote, local = self.keys(), store.keys()
        fetch = sorted(remote - local)
        publish = sorted(local - remote)
        with ThreadPoolExecutor(max_workers=THREADS) as pool:
            fetched = pool.map(self.fetch, fetch)
            store._insert_many((key, *reply) for key, reply in zip(fetch, fetched, strict=True))
            rows = [store._row(key) for key in publish]
            list(pool.map(lambda row: self.publish(*row), rows))
        return len(fetch), len(publish)

    def delete(self, keys: list[str]) -> int:
        return self.bucket.delete(reply_path(k) for k in keys)
