"""The run under Snakemake's object storage (`--default-storage-provider s3
--default-storage-prefix s3://bucket/prefix`): every rule's inputs and outputs are objects
under the prefix, and jobs work on local copies (Snakemake's S3 plugin, no storage code of
ours). What eagleflow keeps beside the outputs follows them into the bucket:

- the per-sample hidden-state store: `storage.states` defaults to `<prefix>/states`, so the
  samples are never left in a job's local copy of `results/` (runtime/state_store.py);
- the response store: `storage.responses` defaults to `<prefix>/responses/<run>`, each job's
  SQLite file a local copy of it (runtime/response_store.py, runtime/reply_bucket.py);
- training's checkpoints: `storage.checkpoints` defaults to the prefix, so that a train job
  resubmitted to another node resumes from the newest (runtime/checkpoint_mirror.py);
- the output cache is off: its entries are hard links beside the outputs on one filesystem,
  and under storage an output is a bucket's object that a link cannot keep
  (docs/operations.md, "Without a shared filesystem").

The credentials are checked before any job runs (runtime.object_store.check_access).
"""

from __future__ import annotations

import os
from typing import Any

from eagleflow.runtime.cache_plan import SWITCH
from eagleflow.runtime.object_store import check_access

SUPPORTED = "s3"


def setup_object_storage(config: dict[str, Any], provider: str | None, prefix: str | None) -> str | None:
    """Fit `config` and this process to the storage provider Snakemake was given; the line
    `snakemake -n` prints about it, or None without one. A provider eagleflow cannot keep its
    stores with, or a bucket the environment's credentials cannot reach, is a ValueError or
    an ObjectStoreError before any job runs."""
    if not provider:
        return None
    if provider != SUPPORTED:
        raise ValueError(
            f"--default-storage-provider {provider}: eagleflow keeps its hidden-state store on S3 only "
            "(--default-storage-provider s3)"
        )
    if not prefix or not prefix.startswith("s3://"):
        raise ValueError(f"--default-storage-prefix {prefix!r}: give the bucket, s3://bucket/prefix")
    storage = config.setdefault("storage", {})
    if not storage.get("states"):
        storage["states"] = f"{prefix.rstrip('/')}/states"
    if not storage.get("responses"):
        storage["responses"] = f"{prefix.rstrip('/')}/responses/{config['run']}"
    if not storage.get("checkpoints"):
        storage["checkpoints"] = prefix.rstrip("/")
    for url in dict.fromkeys([prefix, storage["states"], storage["responses"], storage["checkpoints"]]):
        check_access(url)
    os.environ[SWITCH] = "off"
    return (
        f"Object storage: outputs under {prefix}, the hidden-state store under {storage['states']}/<run>, "
        f"the replies under {storage['responses']}, training's checkpoints under {storage['checkpoints']}; "
        "output cache off (its entries are links on one filesystem)"
    )
