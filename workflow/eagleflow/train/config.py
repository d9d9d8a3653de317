"""The train stage's typed settings (TrainConfig, the `train` section) and where one training
run reads and writes (TrainJob)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TrainConfig:
    """The `train` config section."""

    method: str  # the draft method: a name train.methods.METHODS registers
    num_layers: int
    ttt_steps: int  # EAGLE-3: the chain's draft tokens
    num_depths: int  # P-EAGLE: tokens drafted in one forward
    block_size: int  # the DFlash family: the block drafted in one forward
    ttt_step_loss_decay: float
    loss: str
    loss_implementation: str
    attn_impl: str
    sliding_window: int | None
    draft_attention: str
    optimizer: str  # adamw | muon (train.optimizer)
    lr: float
    lr_schedule: str  # linear | cosine: the decay after the warmup (train.steps.lr_at)
    weight_decay: float
    warmup_steps: int
    grad_clip: float
    epochs: int
    batch_tokens: int
    log_every: int
    eval_every: int
    checkpoint_every: int
    keep_checkpoints: int
    sample_fraction: float
    nproc_per_node: int
    seed: int
    gpus: int
    # EAGLE-3's optional norms (speculators' norm_before_fc and norm_output): an RMSNorm over the
    # concatenated aux states before the fc projection, and the draft's recurrent state taken
    # after its final norm instead of before it. vLLM reads both from the draft's config.
    norm_before_fc: bool
    norm_output: bool


@dataclass(frozen=True)
class TrainJob:
    """Where one training run reads and writes, and the threads of each process."""

    shards: list[str]  # offline: the hidden-state shards (empty online)
    vocab_map: str
    index: str | None  # offline: the shards' index.json
    verifier_dir: str
    draft_out: str
    metrics_out: str
    checkpoint_dir: str  # resumable checkpoints, under <checkpoint_dir>/<fingerprint>/
    serve_verifier_path: str  # the verifier path the exported draft names
    threads: int
    # Online mode (train/online.py): the dataset's train and eval parquet, the hidden_states
    # settings the states are computed with, and the job's log (the load ledger sits by it).
    dataset: list[str] = dataclasses.field(default_factory=list)
    online: dict[str, Any] | None = None
    # Served mode (train/served.py): {"states": what shapes them (aux layer ids, dtype, the
    # server's result flags), "settings": hidden_states.served, "server": the server section}.
    served: dict[str, Any] | None = None
    log_path: str | None = None
    # The output cache's entry the finished draft and metrics are kept in, {"dir", "slot",
    # "key"} (train.launch): kept by rank 0 before it drops the checkpoints, so that no
    # failure after training can cost the steps.
    keep_as: dict[str, str] | None = None
    # The `storage` section: the local cache of states read from a bucket (runtime.object_store),
    # and where checkpoints are copied (storage.checkpoints: runtime/checkpoint_mirror.py).
    storage: dict[str, Any] | None = None
