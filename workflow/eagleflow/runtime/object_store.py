"""S3-compatible object storage for what a run keeps beside Snakemake's outputs: the per-sample
hidden-state store in a bucket (runtime/state_store.py: BucketSampleStore) and the trainer's
bounded local copies of it (FetchCache).

Credentials and the endpoint come from the environment only, under the names Snakemake's S3
storage plugin reads (`SNAKEMAKE_STORAGE_S3_ACCESS_KEY`, `_SECRET_KEY`, `_TOKEN`,
`_ENDPOINT_URL`, `_REGION`), else boto3's own chain (`AWS_ACCESS_KEY_ID`, `AWS_ENDPOINT_URL`,
~/.aws): never from a config file, never in a log line or an error.

An object is written whole or not at all: a single PUT, or a multipart upload that S3 shows only
once it completes, so a server stopped mid-upload leaves nothing a reader could take for a
finished object. Each object carries the digest its writer computed (metadata `digest`); a
reader checks the file it fetched against the digest the run recorded, so an object changed
behind the workflow's back is refused, never trained on.

Run-only: where bytes lie, never what they are.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)

SCHEME = "s3://"
ENV_PREFIX = "SNAKEMAKE_STORAGE_S3_"  # Snakemake's S3 plugin's settings, read from the environment
DIGEST = "digest"  # the object metadata that holds its writer's digest
DEFAULT_CACHE_GB = 20.0


class ObjectStoreError(RuntimeError):
    """A bucket that cannot be reached, read or trusted, said in words a user can act on."""


def is_bucket_url(location: str | os.PathLike | None) -> bool:
    return isinstance(location, str) and location.startswith(SCHEME)


@dataclass(frozen=True)
class BucketPath:
    """`s3://bucket/prefix`: a bucket and a key prefix without slashes at its ends."""

    bucket: str
    prefix: str

    @classmethod
    def parse(cls, url: str) -> BucketPath:
        if not is_bucket_url(url):
            raise ValueError(f"{url!r} is not an s3:// URL")
        bucket, _, prefix = url[len(SCHEME) :].partition("/")
        if not bucket:
            raise ValueError(f"{url!r} names no bucket")
        return cls(bucket, prefix.strip("/"))

    def key(self, relative: str) -> str:
        return f"{self.prefix}/{relative}" if self.prefix else relative

    def url(self, relative: str = "") -> str:
        key = self.key(relative) if relative else self.prefix
        return f"{SCHEME}{self.bucket}/{key}".rstrip("/")

    def relative(self, key: str) -> str:
        return key[len(self.prefix) + 1 :] if self.prefix else key


def _env(name: str) -> str | None:
    return os.environ.get(ENV_PREFIX + name) or None


@cache
def client():
    """One boto3 S3 client per process (thread-safe), configured from the environment."""
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=_env("ENDPOINT_URL"),
        region_name=_env("REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1",
        aws_access_key_id=_env("ACCESS_KEY"),
        aws_secret_access_key=_env("SECRET_KEY"),
        aws_session_token=_env("TOKEN"),
        config=Config(
            retries={"max_attempts": 5, "mode": "standard"},
            connect_timeout=10,
            read_timeout=120,
            max_pool_connections=64,
        ),
    )


def endpoint() -> str:
    """Where requests go, for messages (no credential is ever part of it)."""
    return client().meta.endpoint_url


def explain(error: BaseException, url: str) -> ObjectStoreError:
    """`error` from boto3, as an ObjectStoreError that says what to fix (no secret in it)."""
    import botocore.exceptions as bx

    where = f"{url} (endpoint {endpoint()})"
    if isinstance(error, (bx.NoCredentialsError, bx.PartialCredentialsError)):
        return ObjectStoreError(
            f"{where}: no S3 credentials. Set {ENV_PREFIX}ACCESS_KEY and {ENV_PREFIX}SECRET_KEY (or AWS_ACCESS_KEY_ID "
            "and AWS_SECRET_ACCESS_KEY) in the environment; a config file never holds them"
        )
    if isinstance(error, bx.ConnectionError | bx.HTTPClientError):
        return ObjectStoreError(
            f"{where}: the S3 endpoint cannot be reached ({type(error).__name__}); is the server up, and is "
            f"{ENV_PREFIX}ENDPOINT_URL right?"
        )
    if isinstance(error, bx.ClientError):
        code = error.response.get("Error", {}).get("Code", "")
        if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403", "InvalidToken"):
            return ObjectStoreError(
                f"{where}: the S3 server refused the credentials ({code}): check {ENV_PREFIX}ACCESS_KEY and "
                f"{ENV_PREFIX}SECRET_KEY (or AWS's) and the key's rights on the bucket"
            )
        return ObjectStoreError(f"{where}: {code or 'error'}: {error}")
    return ObjectStoreError(f"{where}: {type(error).__name__}: {error}")


def check_access(url: str, create: bool = True) -> None:
    """Raise ObjectStoreError unless `url`'s bucket answers to this environment's credentials:
    before any job starts, not after hours of work. A missing bucket is made (`create`), as
    Snakemake's plugin makes it on its first upload."""
    import botocore.exceptions as bx

    where = BucketPath.parse(url)
    try:
        client().list_objects_v2(Bucket=where.bucket, Prefix=where.key(""), MaxKeys=1)
    except bx.ClientError as e:
        if e.response.get("Error", {}).get("Code") != "NoSuchBucket" or not create:
            raise explain(e, url) from None
        try:
            client().create_bucket(Bucket=where.bucket)
        except bx.ClientError as e2:
            raise explain(e2, url) from None
    except (bx.BotoCoreError, OSError) as e:
        raise explain(e, url) from None


class Bucket:
    """Objects under one `s3://bucket/prefix`, by their path relative to it."""

    def __init__(self, url: str):
        self.where = BucketPath.parse(url)
        self.url = self.where.url()

    def _call(self, what: Callable, relative: str = ""):
        import botocore.exceptions as bx

        try:
            return what()
        except (bx.BotoCoreError, bx.ClientError, OSError) as e:
            raise explain(e, self.where.url(relative)) from None

    def listing(self, under: str = "") -> Iterator[tuple[str, int]]:
        """(relative path, size) of every object under `under`, in key order."""
        pages = (
            client().get_paginator("list_objects_v2").paginate(Bucket=self.where.bucket, Prefix=self.where.key(under))
        )
        for page in self._call(lambda: list(pages), under):
            for obj in page.get("Contents", []):
                yield self.where.relative(obj["Key"]), int(obj["Size"])

    def recorded_digest(self, relative: str) -> str | None:
        """The digest the object's writer recorded; None where there is no such object."""
        import botocore.exceptions as bx

        try:
            head = client().head_object(Bucket=self.where.bucket, Key=self.where.key(relative))
        except bx.ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise explain(e, self.where.url(relative)) from None
        except (bx.BotoCoreError, OSError) as e:
            raise explain(e, self.where.url(relative)) from None
        return head.get("Metadata", {}).get(DIGEST, "")

    def put(self, relative: str, local: Path, digest: str | None = None) -> None:
        """Upload `local` as `relative` (with `digest` recorded where given), replacing any
        object there: for what is written again under its name, a checkpoint's files."""
        extra = {"Metadata": {DIGEST: digest}} if digest is not None else None
        self._call(
            lambda: client().upload_file(str(local), self.where.bucket, self.where.key(relative), ExtraArgs=extra),
            relative,
        )

    def put_once(self, relative: str, local: Path, digest: str) -> bool:
        """Upload `local` as `relative` with its digest, unless an object is there already (the
        first writer's object stands: objects are never overwritten). True when uploaded."""
        if self.recorded_digest(relative) is not None:
            return False
        self.put(relative, local, digest)
        return True

    def download(self, relative: str, dest: Path, check: Callable[[Path], None] | None = None) -> None:
        """Download `relative` to `dest` atomically: into a temporary beside it, which `check`
        (where given) may refuse by raising, renamed into place once complete."""
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{os.getpid()}.{threading.get_ident()}.part")
        try:
            self._call(lambda: client().download_file(self.where.bucket, self.where.key(relative), str(tmp)), relative)
            if check is not None:
                check(tmp)
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)

    def fetch(self, relative: str, dest: Path, expect: str, digest_of: Callable[[Path], str]) -> None:
        """Download `relative` to `dest` as `download` does, refused unless `digest_of(file)` is
        `expect`, the digest the run recorded."""

        def recorded(tmp: Path) -> None:
            found = digest_of(tmp)
            if found != expect:
                raise ObjectStoreError(
                    f"{self.where.url(relative)}: its content digest is {found}, the run recorded {expect}: the "
                    "object changed after it was written. Delete it and rerun its hidden_states job"
                )

        self.download(relative, dest, recorded)

    def delete(self, relatives: Iterable[str]) -> int:
        """Delete the objects `relatives` name, a thousand per request. Returns how many."""
        batch, done = [], 0
        for rel in [*relatives, None]:
            if rel is not None:
                batch.append({"Key": self.where.key(rel)})
            if batch and (len(batch) == 1000 or rel is None):
                objects = {"Objects": batch, "Quiet": True}
                self._call(lambda o=objects: client().delete_objects(Bucket=self.where.bucket, Delete=o))
                done, batch = done + len(batch), []
        return done


class FetchCache:
    """Local copies of a bucket's objects for a reader that knows what it reads next: at most
    `max_bytes` on disk (the least recently used copies go first, never one of the last batch
    asked for), `threads` downloads at once, each checked against its recorded digest."""

    def __init__(self, bucket: Bucket, root: Path, max_bytes: int, threads: int, digest_of: Callable[[Path], str]):
        self.bucket, self.root, self.max_bytes, self.digest_of = bucket, Path(root), max_bytes, digest_of
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="fetch")
        self._lock = threading.Lock()
        self._pending: dict[str, Future] = {}
        self._held: OrderedDict[str, int] = OrderedDict()  # relative -> bytes, least recent first
        self._pinned: set[str] = set()
        self.fetched = self.fetched_bytes = 0
        self.wait_s = 0.0
        self.owns_root = False  # a directory of its own, removed on close

    @classmethod
    def for_bucket(cls, url: str, storage: dict, digest_of: Callable[[Path], str]) -> FetchCache:
        """A cache of `url`'s objects as the `storage` config section sizes it (cache_gb,
        fetch_threads, cache_dir: default a directory of this process's under the system's
        temporary one), after checking that the bucket answers."""
        check_access(url, create=False)
        root = storage.get("cache_dir") or tempfile.mkdtemp(prefix="eagleflow-states-")
        cache_gb = float(storage.get("cache_gb", DEFAULT_CACHE_GB))
        cache = cls(Bucket(url), Path(root), int(cache_gb * 1e9), int(storage.get("fetch_threads", 16)), digest_of)
        cache.owns_root = not storage.get("cache_dir")
        return cache

    def local(self, relative: str) -> Path:
        return self.root / relative

    def prefetch(self, items: list[tuple[str, str]]) -> None:
        """Start fetching (relative, expected digest) for each of `items` not held or on its way;
        these stay pinned until the next call."""
        with self._lock:
            self._pinned = {rel for rel, _ in items}
            for rel, digest in items:
                if rel in self._held:
                    self._held.move_to_end(rel)
                elif rel not in self._pending:
                    self._pending[rel] = self._pool.submit(self._fetch, rel, digest)

    def get(self, relative: str, digest: str) -> Path:
        """The local copy of `relative`, fetched now if no prefetch asked for it."""
        with self._lock:
            if relative in self._held:
                self._held.move_to_end(relative)
                return self.local(relative)
            future = self._pending.get(relative)
            if future is None:
                future = self._pending[relative] = self._pool.submit(self._fetch, relative, digest)
        started = time.monotonic()
        future.result()
        self.wait_s += time.monotonic() - started
        return self.local(relative)

    def _fetch(self, relative: str, digest: str) -> None:
        path = self.local(relative)
        try:
            self.bucket.fetch(relative, path, digest, self.digest_of)
            size = path.stat().st_size
        finally:
            with self._lock:
                self._pending.pop(relative, None)
        with self._lock:
            self._held[relative] = size
            self.fetched += 1
            self.fetched_bytes += size
            self._evict()

    def _evict(self) -> None:
        held = sum(self._held.values())
        for rel in list(self._held):
            if held <= self.max_bytes:
                break
            if rel in self._pinned:
                continue
            held -= self._held.pop(rel)
            # A reader may hold it open (mapped): unlinking keeps its pages until it closes.
            self.local(rel).unlink(missing_ok=True)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self.owns_root:
            shutil.rmtree(self.root, ignore_errors=True)
