"""Start the training stage: in this process, or as `nproc_per_node` torchrun processes.

With one process the loop runs here. With more, torchrun starts that many copies of
`python -m eagleflow.train SPEC.json` (one per GPU; gloo on CPU), in its own process
group that is killed as a whole on every exit path, SIGTERM from Snakemake included.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from eagleflow.common.atomic import write_text
from eagleflow.common.cache_keys import TRAIN_PACKAGES, stack_identity
from eagleflow.common.config import typed
from eagleflow.common.fingerprint import value_fingerprint
from eagleflow.runtime.cache_plan import clear_mark, entry_location
from eagleflow.runtime.output_cache import OutputCache
from eagleflow.runtime.process import kill_group, package_env
from eagleflow.runtime.smk import stage
from eagleflow.train.config import TrainConfig, TrainJob
from eagleflow.train.fingerprint import job_fingerprint
from eagleflow.train.loop import run_from_json
from eagleflow.train.served_servers import served_backing

log = logging.getLogger(__name__)

STOP_GRACE_S = 60


def main(smk) -> None:
    """The train rule's job (workflow/rules/train.smk)."""
    with stage(smk):
        # Offline the shards and their index; online the dataset (workflow/rules/common.smk: train_states).
        spec = {
            "shards": list(smk.input.get("shards", [])),
            "index": smk.input.get("index"),
            "dataset": list(smk.input.get("dataset", [])),
            "online": smk.params.online,
            # Served mode: what shapes the states (a param), and how they travel (the config's
            # hidden_states.served and server sections: run-only, no param restales on them).
            "served": None
            if smk.params.served is None
            else {
                "states": smk.params.served,
                "settings": smk.config["hidden_states"]["served"],
                "server": smk.config["server"],
            },
            "log_path": smk.log[0],
            # Run-only: where a bucket's states are cached while training reads them.
            "storage": smk.config.get("storage"),
            "vocab_map": smk.input.vocab_map,
            "verifier_dir": smk.input.verifier,
            "draft_out": smk.output.draft,
            "metrics_out": smk.output.metrics,
            "checkpoint_dir": smk.params.checkpoint_dir,
            "serve_verifier_path": served_verifier(smk.params.serve_verifier_path),
            # As configured (relative to the workdir): the key holds no absolute path, so that
            # a run moved to another directory restores its draft.
            "serve_verifier_param": smk.params.serve_verifier_path,
            "cfg": smk.params.train,
            "threads": smk.threads,
        }
        train_or_restore(spec, smk.params.train["nproc_per_node"])


def train_or_restore(spec: dict[str, Any], nproc: int) -> None:
    """Train as run_stage does, unless a run with the same key (config, inputs by content,
    training code, the verifier the draft names, and the software and device that train)
    finished before: then its draft and metrics are linked back, with no process started and
    no step run. Snakemake reruns train whenever a file upstream is rewritten, with the same
    bytes too (generate's code changed, no request did; shards extracted again, the same)."""
    job = TrainJob(**{f.name: spec[f.name] for f in dataclasses.fields(TrainJob) if f.name in spec})
    key = draft_key(job, typed(TrainConfig, spec["cfg"], "train"), spec.get("serve_verifier_param"))
    outputs = {"draft": job.draft_out, "metrics": job.metrics_out}
    cache = OutputCache(*entry_location("train", list(outputs.values())))
    if cache.restore(key, outputs):
        log.info(
            "this draft was trained from the same config, inputs, code and software before (key %s): draft and "
            "metrics linked back from %s; 0 training steps",
            key,
            cache.dir,
        )
        return
    # Rank 0 keeps the outputs before it drops the checkpoints (train.outputs.write_outputs).
    run_stage({**spec, "keep_as": {"dir": str(cache.dir), "slot": cache.slot, "key": key}}, nproc)
    clear_mark(outputs.values())


def draft_key(job: TrainJob, cfg: TrainConfig, serve_verifier: str | None) -> str:
    """The finished draft's key: the training fingerprint (job_fingerprint), the verifier
    path the draft names as configured, and the stack that trains it on this host."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"  # as train.device resolves it
    stack = stack_identity(TRAIN_PACKAGES, device)
    return value_fingerprint([job_fingerprint(job, cfg), serve_verifier or job.serve_verifier_path, stack])


def served_verifier(path: str) -> str:
    """The verifier path the exported draft names. The rule passes it relative to the workdir
    (a param with an absolute path would restale the same results in another directory);
    a path that exists here is named absolute, as vLLM loads it from anywhere on this host,
    and anything else (a hub name, a path on the serving host) as given."""
    return str(Path(path).resolve()) if Path(path).exists() else path


def torchrun_command(spec_path: Path, nproc: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "eagleflow.train",
        str(spec_path),
    ]


def run_stage(spec: dict[str, Any], nproc: int) -> None:
    """Train with `spec` (see loop.run_from_json) on `nproc` processes;
    `spec["threads"]` is the job's, split between the processes. Served mode: what the
    processes share (the Mooncake master, the servers' places) is started here, once, and
    everything the job started is stopped when they end (train/served_servers.py)."""
    spec = {**spec, "threads": max(1, spec["threads"] // nproc)}
    if spec.get("served") is None:
        run_processes(spec, nproc)
        return
    with served_backing(spec["served"], spec["log_path"]) as served:
        run_processes({**spec, "served": served}, nproc)


def run_processes(spec: dict[str, Any], nproc: int) -> None:
    if nproc == 1:
        run_from_json(spec)
        return
    # The spec sits next to the checkpoints: outside the Snakemake outputs, kept for a rerun to read.
    spec_path = Path(spec["checkpoint_dir"]) / "torchrun-spec.json"
    write_text(spec_path, json.dumps(spec, indent=1))
    env = package_env(dict(os.environ))
    cmd = torchrun_command(spec_path, nproc)
    log.info("launching %d training processes: %s", nproc, " ".join(cmd))
    proc = subprocess.Popen(cmd, env=env, stdout=sys.stderr, stderr=sys.stderr, start_new_session=True)
    try:
        rc = proc.wait()
    finally:
        # The ranks share torchrun's process group: none may outlive the job, whoever exits first.
        kill_group(proc.pid, STOP_GRACE_S)
        rc = proc.wait()
    if rc != 0:
        raise RuntimeError(
            f"torchrun with {nproc} training processes exited with {rc}: see the rank logs above in this log"
        )
