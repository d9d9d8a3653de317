"""The training loop, top to bottom: setup (data, model, optimizer), resume, the step loop
(step, log, validate, checkpoint), export (train/outputs.py).

Validation (train/evaluation.py) runs on the held-out split every `eval_every` steps and at
the end of every epoch; the draft exported is the one with the lowest validation loss.

Data parallel: under torchrun every rank runs this same loop. A step consumes `world_size`
consecutive batches of the epoch's packing, one per rank (train/schedule.py); each rank scales its loss by
world_size / (batches in this step) and DistributedDataParallel averages the gradients over
the ranks, which is exactly gradient accumulation over those batches. A rank the epoch's last
step has no batch for runs the step's first one with its loss scaled to nothing, so that it
takes part in DDP's all-reduce. Metrics are summed across ranks; only rank 0 writes
metrics, checkpoints and the draft. With one process it is the plain loop.

Resume: every `checkpoint_every` steps the full training state is checkpointed under
`checkpoint_dir/<fingerprint>/` (train/fingerprint.py); a rerun with the same config, inputs and code continues
from the newest one and produces the same metrics rows and weights as an uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from tqdm import tqdm

from eagleflow.common.config import typed
from eagleflow.runtime.checkpoint_mirror import BucketCheckpoints
from eagleflow.train.checkpoint import (
    TrainState,
    checkpoints,
    latest_checkpoint,
    restore,
    save_checkpoint,
    trainable_state,
)
from eagleflow.train.config import TrainConfig, TrainJob
from eagleflow.train.data import Sample, ShardRef, ShardSamples, read_ahead
from eagleflow.train.device import Runtime, init_runtime
from eagleflow.train.draft import take_precomputed_targets
from eagleflow.train.evaluation import Walk, evaluate
from eagleflow.train.fingerprint import job_fingerprint
from eagleflow.train.methods import DraftMethod, DraftSpec, draft_method, method_attn_impl
from eagleflow.train.online import TokenSample, VerifierStates, load_token_samples, open_verifier
from eagleflow.train.optimizer import build_optimizer
from eagleflow.train.outputs import served_rows, write_outputs
from eagleflow.train.schedule import Position, Schedule
from eagleflow.train.served import ServedStates
from eagleflow.train.steps import Window, lr_at, packed_batch, train_step

log = logging.getLogger(__name__)

# Called with the step number once a step (and its checkpoint, if due) is done. Production
# wires none; the resume tests wire one that kills the process there.
StepCallback = Callable[[int], None]


# --- the loop --------------------------------------------------------------------------------


def run_train(job: TrainJob, cfg: TrainConfig, on_step_end: StepCallback | None = None) -> None:
    """Train a draft as `cfg` says on `job`'s inputs and export the best one."""
    torch.set_num_threads(job.threads)
    rt = init_runtime(cfg)
    trainer = None
    try:
        trainer = Trainer.setup(job, cfg, rt)
        trainer.resume()
        trainer.fit(on_step_end)
        trainer.export()
    finally:
        if trainer is not None and isinstance(trainer.source, ServedStates):
            trainer.source.close()
        if trainer is not None and getattr(trainer.source, "fetch", None) is not None:
            fetch = trainer.source.fetch  # a bucket's samples, read through the local cache
            log.info(
                "states from %s: %d files fetched (%.3f GB), %.1f s waited on them",
                fetch.bucket.url,
                fetch.fetched,
                fetch.fetched_bytes / 1e9,
                fetch.wait_s,
            )
            fetch.close()
        if rt.world_size > 1 and dist.is_initialized():
            # DDP's reducer holds the process group. Dropped only when this function returned,
            # after the group was destroyed, gloo's destructor ran once the other rank had
            # exited and waited on it for good (rank 0, after its export, in a CI run). Dropped
            # first, the group goes down inside destroy_process_group, every rank still in it.
            del trainer
            dist.destroy_process_group()


def run_from_json(spec: dict[str, Any], on_step_end: StepCallback | None = None) -> None:
    """Entry for `python -m eagleflow.train SPEC.json` (and torchrun): TrainJob's
    fields and the train config section under "cfg", as JSON."""
    job = TrainJob(**{f.name: spec[f.name] for f in dataclasses.fields(TrainJob) if f.name in spec})
    run_train(job, typed(TrainConfig, spec["cfg"], "train"), on_step_end)


@dataclass
class Trainer:
    """A training run's model, data and position. `setup`, `resume`, `fit`, `export`."""

    job: TrainJob
    cfg: TrainConfig
    rt: Runtime
    model: torch.nn.Module
    stepped: torch.nn.Module  # the model as a step runs it (Runtime.stepped: DDP across ranks)
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    method: DraftMethod  # train.method: the draft model, its data's alignment and metrics
    # What training reads, per batch, through `source`: refs to the shards' samples, or online
    # and served the dataset's token samples; the eval split likewise (online and served:
    # computed once, at setup).
    train: list[ShardRef] | list[TokenSample]
    evals: list[ShardRef] | list[Sample]
    source: ShardSamples | VerifierStates | ServedStates  # turns `train` items into samples with their states
    schedule: Schedule  # the batches of every step, on this rank
    total_steps: int
    fwd_kwargs: dict[str, Any]
    keys: list[str]
    fingerprint: str
    checkpoint_dir: Path
    mirror: BucketCheckpoints | None  # the checkpoints' copies in a bucket (storage.checkpoints)
    state: TrainState = dataclasses.field(default_factory=TrainState)
    best: dict[str, torch.Tensor] | None = None  # trainable weights of the best validation (rank 0)

    @classmethod
    def setup(cls, job: TrainJob, cfg: TrainConfig, rt: Runtime) -> Trainer:
        """Data, draft model, optimizer and the step schedule."""
        torch.manual_seed(cfg.seed)
        fingerprint = job_fingerprint(job, cfg)
        method = draft_method(cfg.method)
        # Data: refs to the samples the index names, or (online) the dataset's tokens and the verifier,
        # in the method's alignment.
        vocab = load_file(job.vocab_map)
        if job.served is not None:  # served mode: a vLLM server extracts them as training asks
            train, eval_tokens = load_token_samples(*job.dataset, train_fraction=cfg.sample_fraction)
            source = ServedStates(job.verifier_dir, job.served, job.log_path or "train.log", method.align)
            evals = source.samples(eval_tokens)
        elif job.online is None:
            source = ShardSamples.from_index(job.index, t2d=vocab["t2d"], align=method.align, storage=job.storage)
            train, evals = source.refs(cfg.sample_fraction)
        else:
            train, eval_tokens = load_token_samples(*job.dataset, train_fraction=cfg.sample_fraction)
            source = open_verifier(job.verifier_dir, job.online, rt.device, job.log_path, rt.is_main, method.align)
            evals = source.samples(eval_tokens)
        aux_layer_ids = source.aux_layer_ids
        if not train or not evals:
            where = "the hidden-state shards" if job.index else "the dataset"
            raise ValueError(f"{where}: {len(train)} train and {len(evals)} eval samples; both must be non-empty")
        spec = DraftSpec(
            job.verifier_dir, vocab["d2t"], vocab["t2d"], aux_layer_ids, method_attn_impl(method, rt.attn_impl)
        )
        model = method.build(spec, cfg).to(rt.device)
        if isinstance(source, ShardSamples) and source.compact:  # shards with the compact target
            take_precomputed_targets(model)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = build_optimizer(model, cfg.optimizer, cfg.lr, cfg.weight_decay)
        schedule = Schedule.packed(train, cfg.batch_tokens, cfg.seed, cfg.epochs, rt.world_size, rt.rank)
        trainer = cls(
            job=job,
            cfg=cfg,
            rt=rt,
            model=model,
            stepped=rt.stepped(model),
            params=params,
            optimizer=optimizer,
            method=method,
            train=train,
            evals=evals,
            source=source,
            schedule=schedule,
            total_steps=schedule.total_steps,
            fwd_kwargs=method.forward_kwargs(cfg, rt.loss_implementation),
            keys=method.metric_keys(cfg),
            fingerprint=fingerprint,
            checkpoint_dir=Path(job.checkpoint_dir) / fingerprint,
            mirror=BucketCheckpoints.for_job(job.storage, Path(job.checkpoint_dir) / fingerprint),
        )
        if rt.is_main:
            trainer.log_setup()
        return trainer

    def log_setup(self) -> None:
        rt, root = self.rt, self.checkpoint_dir.parent
        log.info(
            "%s draft: %.2fM trainable params; %d train / %d eval samples (%d / %d tokens); %d steps on %d %s "
            "process(es); attention %s, loss %s; checkpoints in %s",
            self.cfg.method,
            sum(p.numel() for p in self.params) / 1e6,
            len(self.train),
            len(self.evals),
            sum(map(len, self.train)),
            sum(map(len, self.evals)),
            self.total_steps,
            rt.world_size,
            rt.device.type,
            rt.attn_impl,
            rt.loss_implementation,
            self.checkpoint_dir,
        )
        found = root.iterdir() if root.is_dir() else []
        others = sorted(p.name for p in found if p.is_dir() and p.name != self.fingerprint)
        if others:
            log.info("not resuming checkpoints of other configs/inputs/code in %s: %s", root, ", ".join(others))

    def resume(self) -> None:
        """Continue from the newest checkpoint of this fingerprint, if there is one."""
        rt = self.rt
        if self.mirror is not None:  # a job on a node without them: the bucket's newest first
            if rt.is_main:
                self.mirror.fetch_newest(self.checkpoint_dir, [p.name for p in checkpoints(self.checkpoint_dir)])
            if rt.world_size > 1:
                dist.barrier()
        ckpt = latest_checkpoint(self.checkpoint_dir, self.fingerprint)
        if ckpt is not None:
            restore(ckpt, self.model, self.optimizer)
            self.state, self.best = ckpt.state, ckpt.best
            if rt.is_main:
                log.info(
                    "resuming from step %d of %d (%s; epoch %d, batch %d; best eval loss %s)",
                    self.state.step,
                    self.total_steps,
                    ckpt.path,
                    self.state.epoch,
                    self.state.batch_index,
                    f"{self.state.best_loss:.4f}" if self.best is not None else "none yet",
                )
        elif rt.is_main:
            log.info("starting at step 0 of %d (no checkpoint in %s)", self.total_steps, self.checkpoint_dir)
        if rt.world_size > 1:
            for p in self.params:  # identical seeds give identical weights; make it explicit
                dist.broadcast(p.data, src=0)
        if not rt.is_main:
            self.best = None  # only rank 0 writes the draft

    def fit(self, on_step_end: StepCallback | None = None) -> None:
        """The step loop, from the resumed position to the last step."""
        cfg, rt, state = self.cfg, self.rt, self.state
        window = Window.restore(state.window, self.keys, rt.device)
        self.model.train()
        bar = tqdm(
            total=self.total_steps,
            initial=state.step,
            desc="train",
            unit="step",
            mininterval=2.0,
            disable=not rt.is_main,
        )
        # Offline, the next step's batch is read from the shards while this one runs; online
        # its states come from the verifier on the training device, in the loop's own thread;
        # served, the feed asks the server for the batches ahead, from the resumed step on.
        if isinstance(self.source, ServedStates):
            self.source.expect(self.my_batches(state.epoch, state.batch_index))
        todo = read_ahead(
            self.schedule.steps_from(state.epoch, state.batch_index), self.read_step, self.job.online is None
        )
        for (epoch, j, n_steps), (step_batches, batch, counted) in todo:
            lr, grad_norm = self.step(step_batches, batch, counted, window)
            state.step += 1
            state.epoch, state.batch_index = (epoch, j + 1) if j + 1 < n_steps else (epoch + 1, 0)
            bar.update()
            # Log: a train row every log_every steps and at the last.
            if state.step % cfg.log_every == 0 or state.step == self.total_steps:
                row = self.train_row(epoch, lr, grad_norm, window)
                bar.set_postfix(
                    loss=f"{row['loss']:.3f}",
                    acc0=f"{self.method.first_accuracy(row):.2f}",
                    tok_s=f"{row['tokens_per_s']:.0f}",
                    refresh=False,
                )
            # Validate: at the end of every epoch and every eval_every steps.
            end_of_epoch = j + 1 == n_steps
            if end_of_epoch or (cfg.eval_every and state.step % cfg.eval_every == 0):
                with window.paused():  # tokens/s measures training, not validation
                    self.validate(epoch, end_of_epoch)
            # Checkpoint: every checkpoint_every steps; the last step's outputs are the draft.
            if cfg.checkpoint_every and state.step % cfg.checkpoint_every == 0 and state.step < self.total_steps:
                self.checkpoint(window)
            if on_step_end is not None:
                on_step_end(state.step)
        bar.close()

    def my_batches(self, epoch: int, batch_index: int) -> Iterator[list[Any]]:
        """This rank's batch of every step from a position on, as its items (read_step's)."""
        for position in self.schedule.steps_from(epoch, batch_index):
            yield [self.train[i] for i in self.schedule.rank_batch(position)[2]]

    def read_step(self, position: Position) -> tuple[list[list[int]], dict[str, torch.Tensor], bool]:
        """The step's batches (Schedule.rank_batch), this rank's read with its states and packed,
        and whether it counts."""
        step_batches, counted, mine = self.schedule.rank_batch(position)
        return step_batches, packed_batch(self.samples(mine), self.cfg.batch_tokens, self.rt), counted

    def step(
        self, step_batches: list[list[int]], batch: dict[str, torch.Tensor], counted: bool, window: Window
    ) -> tuple[float, torch.Tensor]:
        """One optimizer step on this rank's `batch` of `step_batches`; adds its metrics to `window`."""
        rt, cfg = self.rt, self.cfg
        lr = lr_at(self.state.step, self.total_steps, cfg.lr, cfg.warmup_steps, cfg.lr_schedule)
        grad_norm, reduced = train_step(
            self.stepped,
            self.params,
            self.optimizer,
            batch,
            rt,
            self.fwd_kwargs,
            lr=lr,
            # DDP averages over the ranks: scaled back, the sum over this step's batches.
            loss_scale=rt.world_size / len(step_batches),
            grad_clip=cfg.grad_clip,
            keys=self.keys,
            counted=counted,
        )
        window.sums += reduced
        window.tokens += sum(min(len(self.train[i]), cfg.batch_tokens) for b in step_batches for i in b)
        return lr, grad_norm

    def samples(self, indices: list[int]) -> list[Sample]:
        """Training samples `indices` with their states: read from the shards now (online:
        computed now)."""
        return self.source.samples([self.train[i] for i in indices])

    def eval_samples(self, items: list[ShardRef] | list[Sample]) -> list[Sample]:
        """Eval samples with their states: read from the shards now (online: computed at setup)."""
        return self.source.samples(items) if isinstance(self.source, ShardSamples) else items

    def train_row(self, epoch: int, lr: float, grad_norm: torch.Tensor, window: Window) -> dict[str, Any]:
        """The metrics row of the steps since the last one; starts the next window."""
        elapsed = time.monotonic() - window.started
        row = {
            "step": self.state.step,
            "epoch": epoch,
            "split": "train",
            "lr": lr,
            "grad_norm": float(grad_norm),
            "tokens": window.tokens,
            "tokens_per_s": window.tokens / elapsed,
            **self.method.summarise(dict(zip(self.keys, window.sums.tolist(), strict=True)), self.cfg),
        }
        self.state.rows.append(row)
        window.reset()
        return row

    def validate(self, epoch: int, end_of_epoch: bool) -> None:
        """Validation metrics as a row; the best weights so far are kept for export."""
        state = self.state
        val = evaluate(
            self.model,
            self.evals,
            self.cfg.batch_tokens,
            self.fwd_kwargs,
            self.rt,
            self.keys,
            lambda totals: self.method.summarise(totals, self.cfg),
            self.eval_samples,
            walk=Walk.of(self.method, self.cfg),
        )
        state.rows.append(
            {"step": state.step, "epoch": epoch, "split": "eval", "train_samples": len(self.train), **val}
        )
        if val["loss"] < state.best_loss:
            state.best_loss, state.best_step = val["loss"], state.step
            if self.rt.is_main:
                self.best = {k: v.detach().clone() for k, v in trainable_state(self.model).items()}
        if end_of_epoch and self.rt.is_main:
            log.info(
                "epoch %d: eval loss %.4f, estimated acceptance length %.3f",
                epoch,
                val["loss"],
                val["estimated_acceptance_length"],
            )

    def checkpoint(self, window: Window) -> None:
        """Rank 0 saves everything a rerun needs to continue from this step."""
        if not self.rt.is_main:
            return
        self.state.window = window.saved(self.keys)
        path = save_checkpoint(
            self.checkpoint_dir,
            self.fingerprint,
            self.model,
            self.optimizer,
            self.state,
            self.best,
            self.cfg.keep_checkpoints,
        )
        log.info("checkpoint at step %d of %d: %s", self.state.step, self.total_steps, path)
        if self.mirror is not None:
            self.mirror.publish(path, self.cfg.keep_checkpoints)

    def export(self) -> None:
        """Rank 0 writes the best draft and the metrics rows, then drops this run's checkpoints
        (train.outputs)."""
        served = served_rows(self.source, self.rt)
        if self.rt.is_main:
            if self.best is None:
                raise RuntimeError("no validation ran, so there is no best draft to export")
            write_outputs(self.job, self.model, self.best, self.state, self.state.rows + served, self.checkpoint_dir)
            if self.mirror is not None:
                self.mirror.drop()
        if self.rt.world_size > 1:
            dist.barrier()
