"""The training fingerprint: what a training run is, and so which checkpoints it may resume
(train.checkpoint keeps them under it) and, with the verifier that serves the draft, the
finished draft's key (train.launch.draft_key).

It is keyed by everything that determines training (the train config, the identity of the
inputs, the code): a changed config never resumes a stale checkpoint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from eagleflow.common.fingerprint import code_fingerprint, value_fingerprint
from eagleflow.common.identity import content_digest, verifier_fingerprint
from eagleflow.hidden_states.shard_file import shard_content_digest
from eagleflow.train.config import TrainConfig, TrainJob

# Keys of the train config that change when or how often something is written, not what is trained.
NON_DETERMINING_KEYS = frozenset({"checkpoint_every", "keep_checkpoints", "gpus"})


# What training reads of index.json besides its samples; the rest names paths and backends,
# which the samples' content digests make irrelevant (a re-extraction by the other backend that
# writes the same states is the same data).
INDEX_LAYOUT_KEYS = (
    "aux_layer_ids",
    "final_layer_id",
    "vllm_layer_ids",
    "num_layers",
    "hidden_size",
    "dtype",
    "target_topk",
    "convention",
    "num_samples",
    "num_tokens",
)


def index_identity(index: str) -> dict[str, Any]:
    """The part of index.json that shapes training. Reads the file."""
    data = json.loads(Path(index).read_text())
    # Each sample by id, split, length and the digest of what its file holds for it: not where
    # the file lies (file, row) or its store key (which names the software that extracted it).
    return {k: data.get(k) for k in INDEX_LAYOUT_KEYS} | {
        "samples": [[s["id"], s["split"], s["num_tokens"], s["digest"]] for s in data.get("samples", [])]
    }


def training_fingerprint(
    cfg: dict[str, Any],
    index: str | None,
    vocab_map: str,
    shards: list[str],
    code: str,
    online: dict[str, Any] | None = None,
    verifier: str | None = None,
) -> str:
    """What a checkpoint is valid for: train config, input identity and code fingerprint.

    The vocab map is hashed by content (a small file); index.json by what training reads of
    it (the layout: layers, sizes, dtype, target, counts, and each sample by the digest of what
    its file holds, which the extraction writes into the file's header and the index copies),
    not by where the files and the verifier were or which backend wrote them
    (`index_identity`): hashing hundreds of GB on every start is too slow, and a re-extraction
    that writes the same states is the same data (early cut-off by content: no draft is
    retrained for it). `shards`: files given besides the index (tests), by name and digest.
    Online, the dataset's parquet files count by content, and the settings the states are
    computed with. `verifier`: the verifier's content fingerprint
    (training reads its embeddings and head, and online its states).
    """

    def file_sha(path: str) -> str:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()

    def identity(path: str) -> list:
        if path.endswith(".safetensors"):
            return [Path(path).name, shard_content_digest(path)]
        return [Path(path).name, content_digest(path)]

    return value_fingerprint(
        {
            "train": {k: v for k, v in sorted(cfg.items()) if k not in NON_DETERMINING_KEYS},
            "index": index_identity(index) if index else None,
            "vocab_map": file_sha(vocab_map),
            "shards": [identity(s) for s in shards],
            "code": code,
            **({"online": online} if online is not None else {}),
            **({"verifier": verifier} if verifier is not None else {}),
        }
    )


def job_fingerprint(job: TrainJob, cfg: TrainConfig) -> str:
    """What a training run is: its config, inputs and the code that trains (the checkpoints'
    key, and with the named verifier the finished draft's)."""
    return training_fingerprint(
        dataclasses.asdict(cfg),
        job.index,
        job.vocab_map,
        job.shards or job.dataset,
        code_fingerprint("eagleflow.train.loop"),
        # Served mode's states are keyed as online's: by the settings that shape them.
        online=job.online if job.served is None else {"served": job.served["states"]},
        verifier=verifier_fingerprint(job.verifier_dir),
    )
