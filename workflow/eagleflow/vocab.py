"""vocab: the draft vocabulary, from the frequencies of loss-masked tokens.

The draft predicts over the `draft_vocab_size` most frequent verifier-generated tokens.
The mapping follows speculators/vLLM: draft index i stands for verifier token
`i + d2t[i]` (d2t holds offsets), draft indices are in ascending verifier-id order, and
`t2d[v]` is True for verifier tokens the draft can propose.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import pyarrow.parquet as pq
import torch

from eagleflow.common.atomic import write_json, write_safetensors
from eagleflow.common.config import typed
from eagleflow.common.verifier_config import read_text_config
from eagleflow.runtime.smk import stage

log = logging.getLogger(__name__)


def token_counts(input_ids: list[list[int]], loss_masks: list[list[int]], vocab_size: int) -> np.ndarray:
    """How often each verifier token appears where the loss mask is 1. Pure."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for ids, mask in zip(input_ids, loss_masks, strict=True):
        ids = np.asarray(ids, dtype=np.int64)
        np.add.at(counts, ids[np.asarray(mask, dtype=bool)], 1)
    return counts


def build_vocab_map(counts: np.ndarray, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) for the `draft_vocab_size` most frequent tokens. Ties break to the lower id. Pure."""
    vocab_size = len(counts)
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(
            f"vocab.draft_vocab_size must be in 1..{vocab_size} (the verifier's vocab), got {draft_vocab_size}"
        )
    order = np.lexsort((np.arange(vocab_size), -counts))  # by count desc, then id asc
    chosen = np.sort(order[:draft_vocab_size])
    d2t = torch.from_numpy(chosen - np.arange(draft_vocab_size)).to(torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[torch.from_numpy(chosen)] = True
    return d2t, t2d


def coverage(counts: np.ndarray, t2d: torch.Tensor) -> float:
    total = counts.sum()
    return float(counts[t2d.numpy()].sum() / total) if total else 0.0


def coverage_curve(train_counts: np.ndarray, eval_counts: np.ndarray, sizes: list[int]) -> list[dict[str, float]]:
    """Coverage of loss tokens in train and eval by the `size` most frequent train tokens,
    for each size: how much a smaller or larger draft vocabulary would keep. Pure."""
    vocab_size = len(train_counts)
    order = np.lexsort((np.arange(vocab_size), -train_counts))
    cum_train = np.concatenate([[0], np.cumsum(train_counts[order])])
    cum_eval = np.concatenate([[0], np.cumsum(eval_counts[order])])
    total_train, total_eval = max(1, int(cum_train[-1])), max(1, int(cum_eval[-1]))
    return [
        {
            "size": int(k),
            "train": float(cum_train[min(k, vocab_size)] / total_train),
            "eval": float(cum_eval[min(k, vocab_size)] / total_eval),
        }
        for k in sorted(set(sizes))
    ]


def curve_sizes(verifier_vocab_size: int, draft_vocab_size: int) -> list[int]:
    """Powers of two from 64 up to the verifier's vocab, plus the configured size. Pure."""
    sizes, k = {draft_vocab_size, verifier_vocab_size}, 64
    while k < verifier_vocab_size:
        sizes.add(k)
        k *= 2
    return sorted(sizes)


@dataclass(frozen=True)
class VocabConfig:
    """The `vocab` config section."""

    draft_vocab_size: int


def main(smk) -> None:
    """The vocab rule's job (workflow/rules/vocab.smk)."""
    with stage(smk):
        cfg = typed(VocabConfig, smk.params.vocab, "vocab")
        run_vocab(
            smk.input.train,
            smk.input.eval,
            smk.input.verifier,
            cfg.draft_vocab_size,
            smk.output.vocab_map,
            smk.output.stats,
        )


def run_vocab(train: str, eval_: str, verifier_dir: str, draft_vocab_size: int, map_out: str, stats_out: str) -> None:
    verifier_vocab_size = int(read_text_config(verifier_dir)["vocab_size"])
    # Streamed: the counts grow batch by batch, never the whole split in memory.
    counts = {}
    for name, path in (("train", train), ("eval", eval_)):
        counts[name] = np.zeros(verifier_vocab_size, dtype=np.int64)
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024, columns=["input_ids", "loss_mask"]):
            counts[name] += token_counts(
                batch.column("input_ids").to_pylist(), batch.column("loss_mask").to_pylist(), verifier_vocab_size
            )
    d2t, t2d = build_vocab_map(counts["train"], draft_vocab_size)
    write_safetensors(map_out, {"d2t": d2t, "t2d": t2d})
    stats = {
        "verifier_vocab_size": verifier_vocab_size,
        "draft_vocab_size": draft_vocab_size,
        "distinct_loss_tokens_train": int((counts["train"] > 0).sum()),
        "loss_tokens_train": int(counts["train"].sum()),
        "coverage_train": coverage(counts["train"], t2d),
        "coverage_eval": coverage(counts["eval"], t2d),
        "coverage_curve": coverage_curve(
            counts["train"], counts["eval"], curve_sizes(verifier_vocab_size, draft_vocab_size)
        ),
    }
    write_json(stats_out, stats)
    log.info(
        "vocab: %d of %d distinct tokens kept; coverage train %.4f eval %.4f",
        draft_vocab_size,
        stats["distinct_loss_tokens_train"],
        stats["coverage_train"],
        stats["coverage_eval"],
    )
