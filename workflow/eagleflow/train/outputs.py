"""What a finished training run leaves behind: the best draft exported as vLLM loads it, the
metrics rows (with, in served mode, what the feeds did), both kept in the output cache under
the draft's key where the job says so; then the run's checkpoints are spent."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from eagleflow.common.atomic import atomic_path, write_jsonl
from eagleflow.runtime.output_cache import OutputCache
from eagleflow.train.checkpoint import TrainState
from eagleflow.train.config import TrainJob
from eagleflow.train.device import Runtime
from eagleflow.train.draft import export_draft
from eagleflow.train.served import ServedStates

log = logging.getLogger(__name__)


def served_rows(source: Any, rt: Runtime) -> list[dict[str, Any]]:
    """Served mode: what the feeds did in every training process (since the job started or
    resumed), as one "served" metrics row; no row otherwise. Every rank calls it: the ranks'
    parts are gathered."""
    if not isinstance(source, ServedStates):
        return []
    parts = [source.part()]
    if rt.world_size > 1:
        parts = [None] * rt.world_size
        dist.all_gather_object(parts, source.part())
    return [{"split": "served", **source.summary(parts)}]


def write_outputs(
    job: TrainJob,
    model: torch.nn.Module,
    best: dict[str, torch.Tensor],
    state: TrainState,
    rows: list[dict[str, Any]],
    checkpoint_dir: Path,
) -> None:
    """Rank 0: the draft, `model` with the trainable weights of the best validation (`best`),
    and the metrics `rows`; kept in the output cache (job.keep_as); then `checkpoint_dir` goes."""
    final = {k: v.detach() for k, v in model.state_dict().items()} | best
    with atomic_path(job.draft_out) as tmp_draft:
        export_draft(model, final, tmp_draft, job.serve_verifier_path)
    write_jsonl(job.metrics_out, rows)
    log.info(
        "exported the best draft (step %d, eval loss %.4f) to %s",
        state.best_step,
        state.best_loss,
        job.draft_out,
    )
    if job.keep_as:
        cache = OutputCache(job.keep_as["dir"], job.keep_as["slot"])
        cache.keep(job.keep_as["key"], {"draft": job.draft_out, "metrics": job.metrics_out})
    # Training is complete and its outputs are written and kept: the checkpoints are spent.
    shutil.rmtree(checkpoint_dir, ignore_errors=True)
