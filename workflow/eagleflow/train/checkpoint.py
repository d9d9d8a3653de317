"""Training checkpoints: everything a killed job needs to continue as if it had never stopped.

A checkpoint is a directory `step-NNNNNNNN/` under a fingerprint directory:

    model.safetensors      trainable draft parameters (frozen verifier rows are rebuilt)
    best.safetensors       trainable parameters of the best draft so far (absent before the first validation)
    optimizer.safetensors  every tensor of the optimizer state, keyed as torch flattens it
                           (get_optimizer_state_dict: "state.<parameter name>.<key>")
    rng.safetensors        torch CPU and CUDA generator states
    state.json             step, data position, best eval loss, metrics rows so far, the
                           optimizer's hyperparameters, python's RNG state

Tensors go through safetensors only (no pickle: a checkpoint from an untrusted disk cannot
run code). A directory appears under its final name only once complete (`atomic_path`), so
a kill mid-write leaves the previous checkpoint as the newest one.

The fingerprint directory is keyed by everything that determines training (the train config,
the identity of the inputs, the code; train.fingerprint): a changed config never resumes a
stale checkpoint.

With `storage.checkpoints` (a bucket; under `--default-storage-provider s3` the run's prefix),
each checkpoint is also copied to `<bucket>/<checkpoint directory>/<fingerprint>/` as it is
written, `state.json` last, so that a job resubmitted to a node without the checkpoints resumes
from the newest the bucket holds whole (runtime/checkpoint_mirror.py, run-only).
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from eagleflow.common.atomic import atomic_path

log = logging.getLogger(__name__)

PREFIX = "step-"


@dataclass
class TrainState:
    """The loop's position and history, apart from model and optimizer tensors."""

    step: int = 0  # optimizer steps taken; the lr schedule is a pure function of it
    epoch: int = 0  # data position: epoch and batch index of the next step
    batch_index: int = 0
    best_loss: float = float("inf")
    best_step: int | None = None
    rows: list[dict[str, Any]] = field(default_factory=list)  # metrics.jsonl rows so far
    window: dict[str, float] = field(default_factory=dict)  # train metrics since the last logged row


# --- optimizer state <-> (tensors, JSON values) ------------------------------------------------

# torch's own flattened optimizer state dict: "state.<parameter name>.<key>" and
# "param_groups.<parameter name>.<key>", keyed by parameter name rather than position.
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def inner_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """train.optimizer.Optimizers steps several torch optimizers as one; torch's state-dict
    functions take them as a list."""
    return list(getattr(optimizer, "optimizers", [optimizer]))


def optimizer_state(model: torch.nn.Module, optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The optimizer's state as torch flattens it (get_optimizer_state_dict): its tensors, for
    safetensors, and its plain values (hyperparameters), for JSON."""
    flat = get_optimizer_state_dict(model, inner_optimizers(optimizer), options=FLAT)
    tensors = {k: v.detach().cpu().contiguous() for k, v in flat.items() if isinstance(v, torch.Tensor)}
    return tensors, {k: v for k, v in flat.items() if not isinstance(v, torch.Tensor)}


def load_optimizer_state(
    model: torch.nn.Module, optimizer, tensors: dict[str, torch.Tensor], values: dict[str, Any]
) -> None:
    """Inverse of optimizer_state, into a freshly built optimizer of the same model. JSON
    keeps no tuples: a hyperparameter's sequence (AdamW's betas, Muon's coefficients) is one."""
    flat = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()} | tensors
    try:
        set_optimizer_state_dict(model, inner_optimizers(optimizer), flat, options=FLAT)
    except KeyError as missing:
        raise ValueError(f"the checkpoint's optimizer state is another train.optimizer's: it lacks {missing}") from None


# --- RNG ---------------------------------------------------------------------------------------


def rng_state() -> tuple[dict[str, torch.Tensor], Any]:
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = s
    version, internal, gauss = random.getstate()
    return tensors, [version, list(internal), gauss]


def set_rng_state(tensors: dict[str, torch.Tensor], python_state: Any) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    cuda = [tensors[k] for k in sorted(k for k in tensors if k.startswith("torch_cuda_"))]
    if cuda and torch.cuda.is_available():
        if len(cuda) != torch.cuda.device_count():
            log.warning(
                "checkpoint holds %d CUDA RNG states, this host has %d devices: restoring the overlap",
                len(cuda),
                torch.cuda.device_count(),
            )
        for i, s in enumerate(cuda[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, i)
    version, internal, gauss = python_state
    random.setstate((version, tuple(internal), gauss))


# --- save / load -------------------------------------------------------------------------------


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


def save_checkpoint(
    directory: Path,
    fingerprint: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: TrainState,
    best: dict[str, torch.Tensor] | None,
    keep: int,
) -> Path:
    """Write checkpoint `step-<state.step>` atomically, then drop all but the newest `keep`."""
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / f"{PREFIX}{state.step:08d}"
    opt_tensors, opt_values = optimizer_state(model, optimizer)
    rng_tensors, python_rng = rng_state()
    with atomic_path(target) as tmp:
        tmp.mkdir()
        save_file({k: v.cpu().contiguous() for k, v in trainable_state(model).items()}, str(tmp / "model.safetensors"))
        if best is not None:
            save_file({k: v.cpu().contiguous() for k, v in best.items()}, str(tmp / "best.safetensors"))
        save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
        save_file(rng_tensors, str(tmp / "rng.safetensors"))
        (tmp / "state.json").write_text(
            json.dumps(
                {
                    "fingerprint": fingerprint,
                    "step": state.step,
                    "epoch": state.epoch,
                    "batch_index": state.batch_index,
                    "best_loss": state.best_loss if best is not None else None,
                    "best_step": state.best_step,
                    "rows": state.rows,
                    "window": state.window,
                    "optimizer": opt_values,
                    "python_rng": python_rng,
                }
            )
        )
        # A killed process loses nothing in the page cache; a crashed node does: sync before the rename.
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    for old in checkpoints(directory)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return target


def checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints in `directory`, oldest first (temporaries start with a dot)."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.name.startswith(PREFIX) and (p / "state.json").is_file())


@dataclass
class Checkpoint:
    path: Path
    state: TrainState
    model: dict[str, torch.Tensor]
    best: dict[str, torch.Tensor] | None
    optimizer: tuple[dict[str, torch.Tensor], dict[str, Any]]  # optimizer_state's tensors and values
    rng: tuple[dict[str, torch.Tensor], Any]


def load_checkpoint(path: Path, fingerprint: str) -> Checkpoint:
    meta = json.loads((path / "state.json").read_text())
    if meta["fingerprint"] != fingerprint:
        raise ValueError(
            f"{path}: checkpoint fingerprint {meta['fingerprint']} != "
            f"{fingerprint}: it belongs to another config, input or code; delete it"
        )
    best_file = path / "best.safetensors"
    state = TrainState(
        step=meta["step"],
        epoch=meta["epoch"],
        batch_index=meta["batch_index"],
        best_loss=meta["best_loss"] if meta["best_loss"] is not None else float("inf"),
        best_step=meta["best_step"],
        rows=meta["rows"],
        window=meta["window"],
    )
    return Checkpoint(
        path=path,
        state=state,
        model=load_file(str(path / "model.safetensors")),
        best=load_file(str(best_file)) if best_file.is_file() else None,
        optimizer=(load_file(str(path / "optimizer.safetensors")), meta["optimizer"]),
        rng=(load_file(str(path / "rng.safetensors")), meta["python_rng"]),
    )


def latest_checkpoint(directory: Path, fingerprint: str) -> Checkpoint | None:
    found = checkpoints(directory)
    return load_checkpoint(found[-1], fingerprint) if found else None


def restore(ckpt: Checkpoint, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load a checkpoint's tensors into a freshly built model and optimizer, and its RNG states."""
    params = dict(model.named_parameters())
    missing = set(trainable_state(model)) - set(ckpt.model)
    if missing:
        raise ValueError(f"{ckpt.path}: checkpoint lacks trainable parameters {sorted(missing)}")
    with torch.no_grad():
        for name, value in ckpt.model.items():
            params[name].copy_(value)
    load_optimizer_state(model, optimizer, *ckpt.optimizer)
    set_rng_state(*ckpt.rng)
