"""Training data: hidden-state shards, shifted into EAGLE-3 alignment and packed to a token budget.

Training holds references to the shards' samples (ShardRef: where a sample is and how long)
and reads each batch's states from the memory-mapped shards when it trains on it
(ShardSamples.samples), so host memory holds a batch or two, not the run's states (the Kimi
example's are terabytes). Packing needs only the lengths; the next step's batch is read in a
background thread while a step runs (read_ahead).

Alignment (as speculators' shift_batch): at position t the draft sees the verifier state
g_t and the embedding of token x_{t+1}, and learns the verifier's distribution at t+1,
i.e. (x_{t+1}, g_t, y_{t+1}, loss_mask_{t+1}). Packed samples get their own document id,
and positions restart (at 1) for each sample.

The verifier's distribution y comes from its final state, or from shards with the compact
target (hidden_states.target: topk; hidden_states/targets.py) from its top-k logits, whose ids are mapped into the draft
vocabulary here; positions where none of them is in it leave the loss.
"""

from __future__ import annotations

import os
import random
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from eagleflow.common.fingerprint import stable_fraction
from eagleflow.hidden_states.shard_file import shard_content_digest
from eagleflow.hidden_states.shard_reader import ShardReader, indexed_entries
from eagleflow.hidden_states.targets import draft_index
from eagleflow.runtime.object_store import FetchCache

T = TypeVar("T")
R = TypeVar("R")

# Seed of the learning curve's subsets; fixed, so that subsets are the same in every run.
SUBSET_SEED = 0


@dataclass
class Sample:
    input_ids: torch.Tensor  # [n] int64
    hidden_states: torch.Tensor  # [n, num_aux * hidden]
    verifier_last_hidden_states: torch.Tensor | None  # [n, hidden]; None with the compact target
    loss_mask: torch.Tensor  # [n] bool
    target_ids: torch.Tensor | None = None  # compact target: [n, k] draft-vocabulary indices, -1 outside it
    target_logits: torch.Tensor | None = None  # compact target: [n, k] float32

    def __len__(self) -> int:
        return self.input_ids.shape[0]


def in_training_subset(sample_id: str, fraction: float) -> bool:
    """Whether a training sample is in the `fraction` subset of the training conversations. Pure.

    Whole conversations (a sample id is `<prompt id>#t<turn>`) are in or out, by a stable hash
    of the prompt id: the same on every run, and a smaller subset lies inside a larger one."""
    return fraction >= 1 or stable_fraction(SUBSET_SEED, sample_id.split("#", 1)[0]) < fraction


def trained_on(sample_id: str, num_tokens: int, is_eval: bool, train_fraction: float) -> bool:
    """Whether training reads a sample: at least two tokens (one after the shift), and an eval
    sample or one of the `train_fraction` subset (in_training_subset). Pure."""
    return num_tokens >= 2 and (is_eval or in_training_subset(sample_id, train_fraction))


@dataclass(frozen=True)
class ShardRef:
    """A sample before its states are read: which file holds it (ShardSamples.files), its
    row there, and its length, the shifted sample's (n - 1)."""

    shard: int
    index: int
    num_tokens: int
    is_eval: bool = False

    def __len__(self) -> int:
        return self.num_tokens - 1


@dataclass(frozen=True)
class Located:
    """Where a sample's states are and what training needs before reading them. Pure data."""

    file: int  # into ShardSamples.files
    row: int
    id: str
    num_tokens: int
    is_eval: bool


# Files a ShardSamples keeps open at once: the store keeps one file per sample, and a run of
# 30,000 samples must not hold 30,000 open files (nor their maps).
OPEN_FILES = 64


def bucket_fetch(store: str, storage: dict[str, Any]) -> FetchCache:
    """The local cache a training process reads a bucket's samples through, each checked
    against the digest its index recorded (the tensors' own, recomputed)."""
    return FetchCache.for_bucket(store, storage, lambda path: shard_content_digest(path, verify=True))


class ShardSamples:
    """The hidden states of a training run, open for reading: refs (what training packs) and,
    per batch, the shifted samples they stand for, states in `dtype`. From an index
    (`from_index`: the pipeline's, over the per-sample store) or from shard files (tests and
    benchmarks). Files with the compact target need the draft vocabulary (`t2d`, the vocab
    map's). Files are opened when a batch reads them, at most OPEN_FILES at once."""

    def __init__(
        self,
        paths: list[str],
        t2d: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float32,
        align: Callable[..., Sample] | None = None,
    ):
        readers = [ShardReader(p) for p in paths]
        if not readers:
            raise ValueError("no hidden-state shards to train on")
        first = readers[0]
        for r in readers[1:]:
            if r.meta.aux_layer_ids != first.meta.aux_layer_ids:
                raise ValueError(
                    f"{r.path}: aux_layer_ids {r.meta.aux_layer_ids} differ from {first.path}'s "
                    f"({first.meta.aux_layer_ids})"
                )
            if r.compact != first.compact:
                raise ValueError(f"{r.path}: its target differs from {first.path}'s (one keeps top-k logits)")
        located = [
            Located(k, i, sample_id, r.num_tokens(i), r.is_eval[i])
            for k, r in enumerate(readers)
            for i, sample_id in enumerate(r.meta.sample_ids)
        ]
        self._setup([r.path for r in readers], located, first.meta.aux_layer_ids, first.compact, t2d, dtype, align)

    @classmethod
    def from_index(
        cls,
        index: str | os.PathLike,
        t2d: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float32,
        align: Callable[..., Sample] | None = None,
        storage: dict[str, Any] | None = None,
    ) -> ShardSamples:
        """The samples index.json names (hidden_states.index.index_document). Where they lie in
        a bucket, each batch's files are fetched, checked against the index's digests, into a
        local cache bounded by `storage` (the config's section: cache_gb, fetch_threads)."""
        doc, entries = indexed_entries(index)
        files: dict[str, int] = {}
        digests: list[str] = []
        located = []
        for file, row, s in entries:
            k = files.setdefault(file, len(files))
            if k == len(digests):
                digests.append(s.get("digest", ""))
            located.append(Located(k, row, s["id"], int(s["num_tokens"]), s["split"] == "eval"))
        if not located:
            raise ValueError(f"{index}: no samples to train on")
        self = cls.__new__(cls)
        self._setup(list(files), located, list(doc["aux_layer_ids"]), bool(doc["target_topk"]), t2d, dtype, align)
        if doc.get("store"):
            self.fetch = bucket_fetch(doc["store"], storage or {})
            self.digests = digests
        return self

    def _setup(self, files, located, aux_layer_ids, compact, t2d, dtype, align) -> None:
        self.files: list[str] = files
        self.located: list[Located] = located
        self.aux_layer_ids: list[int] = aux_layer_ids
        self.compact: bool = compact
        self.dtype = dtype
        self.align = align or shift  # the draft method's alignment (train.methods)
        if compact and t2d is None:
            raise ValueError(f"{files[0]}: the states keep top-k logits (hidden_states.target: topk); pass t2d")
        self.to_draft = draft_index(t2d) if t2d is not None and compact else None
        self._open: OrderedDict[int, ShardReader] = OrderedDict()
        self._lock = threading.Lock()  # read_ahead reads in a thread beside the caller
        self.fetch: FetchCache | None = None  # a bucket's samples: their local copies
        self.digests: list[str] = []

    def local_file(self, k: int) -> str:
        """File `k` on this host: itself, or (in a bucket) its checked local copy."""
        if self.fetch is None:
            return self.files[k]
        return str(self.fetch.get(self.relative(k), self.digests[k]))

    def relative(self, k: int) -> str:
        return self.files[k][len(self.fetch.bucket.url) + 1 :]

    def reader(self, k: int) -> ShardReader:
        """File `k`, opened now or kept open from a recent read."""
        with self._lock:
            if k in self._open:
                self._open.move_to_end(k)
                return self._open[k]
            r = ShardReader(self.local_file(k))
            if r.meta.aux_layer_ids != self.aux_layer_ids:
                raise ValueError(
                    f"{r.path}: aux_layer_ids {r.meta.aux_layer_ids} differ from the index's ({self.aux_layer_ids})"
                )
            if r.compact != self.compact:
                raise ValueError(f"{r.path}: its target differs from the index's (one keeps top-k logits)")
            self._open[k] = r
            if len(self._open) > OPEN_FILES:
                self._open.popitem(last=False)
            return r

    def refs(self, train_fraction: float = 1.0) -> tuple[list[ShardRef], list[ShardRef]]:
        """(train, eval) refs of the samples training reads (trained_on), in file order."""
        train, evals = [], []
        for s in self.located:
            if trained_on(s.id, s.num_tokens, s.is_eval, train_fraction):
                (evals if s.is_eval else train).append(ShardRef(s.file, s.row, s.num_tokens, s.is_eval))
        return train, evals

    def samples(self, refs: list[ShardRef]) -> list[Sample]:
        """The samples `refs` stand for, read from their files now, in the method's alignment."""
        if self.fetch is not None:  # the batch's files, downloaded side by side
            self.fetch.prefetch([(self.relative(r.shard), self.digests[r.shard]) for r in refs])
        out = []
        for ref in refs:
            s = self.reader(ref.shard).sample(ref.index, self.dtype)
            if s.input_ids.shape[0] != ref.num_tokens:
                raise ValueError(
                    f"{self.files[ref.shard]}: row {ref.index} holds {s.input_ids.shape[0]} tokens, "
                    f"the index says {ref.num_tokens}: rerun hidden_states_index"
                )
            target_ids = None if s.target_ids is None else self.to_draft[s.target_ids]
            out.append(self.align(s.input_ids, s.aux, s.final, s.loss_mask, target_ids, s.target_logits))
        return out


def load_shards(
    paths: list[str],
    dtype: torch.dtype = torch.float32,
    train_fraction: float = 1.0,
    t2d: torch.Tensor | None = None,
) -> tuple[list[Sample], list[Sample], list[int]]:
    """(train samples, eval samples, aux layer ids) from hidden-state shards, already shifted,
    all in memory (tests and benchmarks; training reads per batch: ShardSamples); only the
    `train_fraction` subset of the training conversations (in_training_subset)."""
    source = ShardSamples(paths, t2d, dtype)
    train, evals = source.refs(train_fraction)
    return source.samples(train), source.samples(evals), source.aux_layer_ids


def read_ahead(items: Iterable[T], read: Callable[[T], R], ahead: bool = True) -> Iterator[tuple[T, R]]:
    """(item, read(item)) for each of `items`, in order; with `ahead`, the next item is read in
    a background thread while the caller works on this one (training reads a step's batch from
    the shards while the step before it runs). A read's error is raised where its item would
    have been yielded; nothing is read more than one item ahead."""
    if not ahead:
        for item in items:
            yield item, read(item)
        return
    with ThreadPoolExecutor(1, thread_name_prefix="read-ahead") as pool:
        pending = None
        for item in items:
            submitted = (item, pool.submit(read, item))
            if pending is not None:
                yield pending[0], pending[1].result()
            pending = submitted
        if pending is not None:
            yield pending[0], pending[1].result()


def shift(input_ids, hidden_states, last_hidden_states, loss_mask, target_ids=None, target_logits=None) -> Sample:
    """Drop x_0, g_{n-1}, y_0, l_0 so that position t pairs (x_{t+1}, g_t, y_{t+1}, l_{t+1}).
    With the compact target, positions none of whose top-k ids is in the draft vocabulary
    have no target: they leave the loss. Pure."""
    if target_ids is None:
        return Sample(input_ids[1:], hidden_states[:-1], last_hidden_states[1:], loss_mask[1:])
    ids = target_ids[1:]
    mask = loss_mask[1:] & (ids >= 0).any(dim=-1)
    return Sample(input_ids[1:], hidden_states[:-1], None, mask, ids, target_logits[1:])


def unshifted(input_ids, hidden_states, last_hidden_states, loss_mask, target_ids=None, target_logits=None) -> Sample:
    """DFlash's alignment: speculators applies shift_batch to EAGLE-3 and P-EAGLE only, so a
    block drafter sees (x_t, g_t, y_t, l_t) at position t and targets position t from the
    verifier's state at t - 1 itself. The last position is dropped, so that a sample is as long
    as its shifted form (ShardRef's length): its state predicts past the conversation. Pure."""
    if target_ids is None:
        return Sample(input_ids[:-1], hidden_states[:-1], last_hidden_states[:-1], loss_mask[:-1])
    ids = target_ids[:-1]
    mask = loss_mask[:-1] & (ids >= 0).any(dim=-1)
    return Sample(input_ids[:-1], hidden_states[:-1], None, mask, ids, target_logits[:-1])


def pack(samples: list[Sample], batch_tokens: int, shuffle_seed: int | None) -> list[list[int]]:
    """Greedy first-fit packing of sample indices into batches of at most `batch_tokens`. Pure."""
    order = list(range(len(samples)))
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(order)
    batches, current, used = [], [], 0
    for i in order:
        n = min(len(samples[i]), batch_tokens)
        if current and used + n > batch_tokens:
            batches.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        batches.append(current)
    return batches


def collate(samples: list[Sample], batch_tokens: int) -> dict[str, torch.Tensor]:
    """One packed [1, T] batch in the layout Eagle3DraftModel.forward takes (the compact
    target's top-k pairs as they are: train.steps.to_device makes the dense targets)."""
    cut = [min(len(s), batch_tokens) for s in samples]

    def cat(field: str) -> torch.Tensor:
        return torch.cat([getattr(s, field)[:n] for s, n in zip(samples, cut, strict=True)]).unsqueeze(0)

    compact = samples[0].target_ids is not None
    targets = ("target_ids", "target_logits") if compact else ("verifier_last_hidden_states",)
    return {
        "input_ids": cat("input_ids"),
        "hidden_states": cat("hidden_states"),
        **{name: cat(name) for name in targets},
        "loss_mask": cat("loss_mask"),
        "document_ids": torch.cat([torch.full((n,), d, dtype=torch.long) for d, n in enumerate(cut)]).unsqueeze(0),
        "position_ids": torch.cat([torch.arange(1, n + 1, dtype=torch.long) for n in cut]).unsqueeze(0),
    }
