"""dataset: turn synth samples into training sequences, after the quality gate.

Each sample becomes `input_ids` (the verifier's exact prompt + completion token stream) and
`loss_mask` (1 on verifier-generated tokens). The gate refuses the whole data set when a
defect class exceeds its configured fraction: nothing downstream is built from bad data.
Samples are split into train and eval by a hash of their conversation, so every turn of a
conversation lands on the same side.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from eagleflow.common.atomic import parquet_rows
from eagleflow.common.config import typed
from eagleflow.common.defects import EXCLUDING
from eagleflow.common.fingerprint import stable_fraction
from eagleflow.runtime.smk import stage

log = logging.getLogger(__name__)

SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("length", pa.int32()),
        ("num_loss_tokens", pa.int32()),
    ]
)


class QualityGateError(RuntimeError):
    pass


def sequence_of(
    prompt_token_ids: list[int], completion_token_ids: list[int], max_len: int | None = None
) -> tuple[list[int], list[int]]:
    """input_ids and loss_mask (1 on verifier-generated tokens) of one sample, cut to max_len."""
    input_ids = list(prompt_token_ids) + list(completion_token_ids)
    loss_mask = [0] * len(prompt_token_ids) + [1] * len(completion_token_ids)
    if max_len is not None:
        input_ids, loss_mask = input_ids[:max_len], loss_mask[:max_len]
    return input_ids, loss_mask


def gate_failures(report: dict[str, Any], thresholds: dict[str, float]) -> list[str]:
    """Human-readable reasons the data must not be trained on; empty when it passes."""
    failures = []
    for key, limit in thresholds.items():
        if key == "request_errors":
            frac, count, ex = report["request_error_fraction"], report["request_errors"], report["error_examples"]
        else:
            frac, count, ex = report["fractions"][key], report["counts"][key], report["examples"].get(key, [])
        if frac > limit:
            failures.append(
                f"{key}: {count} samples ({frac:.1%}) exceed the limit of {limit:.1%} "
                f"(dataset.max_defect_fraction.{key}); examples: {', '.join(ex) or '-'}"
            )
    return failures


def build_rows(
    samples: list[dict[str, Any]], max_seq_len: int, excluded_defects: frozenset[str]
) -> list[dict[str, Any]]:
    """Training rows from synth samples, skipping samples with an excluding defect. Pure."""
    rows = []
    for s in samples:
        if excluded_defects.intersection(s["defects"]):
            continue
        input_ids, loss_mask = sequence_of(s["prompt_token_ids"], s["completion_token_ids"], max_seq_len)
        if sum(loss_mask) == 0:
            continue
        rows.append(
            {
                "id": s["id"],
                "prompt_id": s["prompt_id"],
                "input_ids": input_ids,
                "loss_mask": loss_mask,
                "length": len(input_ids),
                "num_loss_tokens": sum(loss_mask),
            }
        )
    return rows


def is_eval(prompt_id: str, eval_fraction: float, seed: int) -> bool:
    return stable_fraction(seed, prompt_id) < eval_fraction


@dataclass(frozen=True)
class DatasetConfig:
    """The `dataset` config section."""

    max_seq_len: int
    eval_fraction: float
    seed: int
    exclude_defects: tuple[str, ...]
    max_defect_fraction: dict[str, float]


def main(smk) -> None:
    """The dataset rule's job (workflow/rules/dataset.smk)."""
    with stage(smk):
        cfg = typed(DatasetConfig, smk.params.dataset, "dataset")
        run_dataset(smk.input.responses, smk.input.quality, smk.output.train, smk.output.eval, cfg)


def run_dataset(
    responses: str, quality: str, train_out: str, eval_out: str, cfg: DatasetConfig, batch_rows: int = 1024
) -> None:
    max_seq_len, eval_fraction, seed = cfg.max_seq_len, cfg.eval_fraction, cfg.seed
    report = json.loads(Path(quality).read_text())
    failures = gate_failures(report, cfg.max_defect_fraction)
    if failures:
        raise QualityGateError(
            f"quality gate refused {responses} ({quality}):\n  "
            + "\n  ".join(failures)
            + "\nFix the parser (synth) or the generator and rerun; or raise the limit in config if the defect is"
            " expected."
        )
    excluded = EXCLUDING | frozenset(cfg.exclude_defects)
    # Streamed: a batch of samples in memory at a time; each row goes to its side as it comes.
    samples, train_loss_tokens = 0, 0
    with parquet_rows(train_out, SCHEMA, batch_rows) as train, parquet_rows(eval_out, SCHEMA, batch_rows) as evals:
        for batch in pq.ParquetFile(responses).iter_batches(batch_size=batch_rows):
            rows = batch.to_pylist()
            samples += len(rows)
            for r in build_rows(rows, max_seq_len, excluded):
                side = evals if is_eval(r["prompt_id"], eval_fraction, seed) else train
                side.write({k: r[k] for k in SCHEMA.names})
                train_loss_tokens += r["num_loss_tokens"] if side is train else 0
        if not train.rows or not evals.rows:
            raise ValueError(
                f"{responses}: {train.rows + evals.rows} usable samples split into {train.rows} train / "
                f"{evals.rows} eval; need both non-empty"
            )
    log.info(
        "dataset: %d samples -> %d train (%d loss tokens), %d eval; %d excluded",
        samples,
        train.rows,
        train_loss_tokens,
        evals.rows,
        samples - train.rows - evals.rows,
    )
