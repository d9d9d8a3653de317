"""Online mode (`hidden_states.mode: online`): the train stage computes the verifier's states
itself, batch by batch, and no shard is ever written.

The states are the offline stage's: the same forward and hooks (hidden_states.forward), the
same layer convention and aux layer ids, rounded to the same storage dtype (fp8 included), then
shifted as shards are (train.data.shift). The eval samples' states are computed once, at setup,
and kept in memory; the training samples' are computed again for every batch of every epoch,
which is what online mode costs: one verifier forward per training batch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import torch

from eagleflow.common.config import typed
from eagleflow.hidden_states.forward import extract, load_verifier, resolve_compute_dtype
from eagleflow.hidden_states.layers import resolve_aux_layer_ids, verifier_geometry
from eagleflow.hidden_states.storage import as_read_back, extraction_dtype, torch_dtype
from eagleflow.runtime.ledger import record_load
from eagleflow.train.data import Sample, shift, trained_on

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OnlineStates:
    """The `hidden_states` settings online training reads (the rest are the offline stage's)."""

    aux_layer_ids: tuple[int, ...] | None
    dtype: str
    compute_dtype: str
    batch_tokens: int
    trust_remote_code: bool


@dataclass(frozen=True)
class TokenSample:
    """A dataset row before its states exist. Its length is the shifted sample's (n - 1)."""

    id: str
    input_ids: list[int]
    loss_mask: list[int]

    def __len__(self) -> int:
        return len(self.input_ids) - 1


def load_token_samples(
    train_path: str, eval_path: str, train_fraction: float
) -> tuple[list[TokenSample], list[TokenSample]]:
    """(train, eval) rows of the dataset, as load_shards keeps them: samples of at least two
    tokens, only the `train_fraction` subset of the training conversations."""
    out = []
    for path, is_eval in ((train_path, False), (eval_path, True)):
        rows = pq.read_table(path, columns=["id", "input_ids", "loss_mask"]).to_pylist()
        out.append(
            [
                TokenSample(r["id"], r["input_ids"], r["loss_mask"])
                for r in sorted(rows, key=lambda r: r["id"])
                if trained_on(r["id"], len(r["input_ids"]), is_eval, train_fraction)
            ]
        )
    return out[0], out[1]


class VerifierStates:
    """The verifier, loaded once on the training device, turning token samples into samples."""

    def __init__(
        self, verifier_dir: str, settings: OnlineStates, device: torch.device, align: Callable[..., Sample] = shift
    ):
        self.align = align  # the draft method's alignment (train.methods)
        self.aux_layer_ids = resolve_aux_layer_ids(settings.aux_layer_ids, verifier_geometry(verifier_dir))
        self.settings = settings
        compute_dtype = resolve_compute_dtype(settings.compute_dtype, device.type)
        self.model = load_verifier(verifier_dir, str(device), compute_dtype, settings.trust_remote_code)
        for p in self.model.parameters():
            p.requires_grad_(False)

    def samples(self, items: list[TokenSample]) -> list[Sample]:
        """The shifted samples of `items`, with the states the offline stage would have stored."""
        states = extract(
            self.model,
            [{"input_ids": s.input_ids} for s in items],
            self.aux_layer_ids,
            self.settings.batch_tokens,
            torch_dtype(extraction_dtype(self.settings.dtype)),
            progress=False,
        )
        out = []
        for s, (aux, final) in zip(items, states, strict=True):
            out.append(
                self.align(
                    torch.tensor(s.input_ids, dtype=torch.long),
                    as_read_back(aux, len(self.aux_layer_ids), self.settings.dtype),
                    as_read_back(final, 1, self.settings.dtype),
                    torch.tensor(s.loss_mask, dtype=torch.bool),
                )
            )
        return out


def open_verifier(
    verifier_dir: str,
    settings: dict[str, Any],
    device: torch.device,
    log_path: str | None,
    is_main: bool,
    align: Callable[..., Sample] = shift,
) -> VerifierStates:
    """Load the verifier for online training; the load goes into the run's load ledger."""
    states = VerifierStates(verifier_dir, typed(OnlineStates, settings, "hidden_states"), device, align)
    if log_path and is_main:
        ledger = Path(log_path).parent / "servers"
        ledger.mkdir(parents=True, exist_ok=True)
        record_load(ledger, Path(log_path), verifier_dir, "start", False)
    log.info(
        "online hidden states: verifier %s on %s, aux layers %s, stored as %s",
        verifier_dir,
        device,
        states.aux_layer_ids,
        settings["dtype"],
    )
    return states
