"""Start the training stage: in this process, or as `nproc_per_node` torchrun processes.

With one process the loop runs here. With more, torchrun starts that many copies of
`python -m workflow_scripts.train SPEC.json` (one per GPU; gloo on CPU), in its own process
group that is killed as a whole on every exit path, SIGTERM from Snakemake included.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from workflow_scripts.common.atomic import write_text
from workflow_scripts.runtime.process import kill_group, package_env
from workflow_scripts.runtime.smk import stage
from workflow_scripts.train.loop import run_from_json

log = logging.getLogger(__name__)

STOP_GRACE_S = 60


def main(smk) -> None:
    """The train rule's job (rules/train.smk)."""
    with stage(smk):
        # Offline the shards and their index; online the dataset (rules/common.smk: train_states).
        spec = {
            "shards": list(smk.input.get("shards", [])),
            "index": smk.input.get("index"),
            "dataset": list(smk.input.get("dataset", [])),
            "online": smk.params.online,
            "log_path": smk.log[0],
            "vocab_map": smk.input.vocab_map,
            "verifier_dir": smk.input.verifier,
            "draft_out": smk.output.draft,
            "metrics_out": smk.output.metrics,
            "checkpoint_dir": smk.params.checkpoint_dir,
            "serve_verifier_path": served_verifier(smk.params.serve_verifier_path),
            "cfg": smk.params.train,
            "threads": smk.threads,
        }
        run_stage(spec, smk.params.train["nproc_per_node"])


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
        "workflow_scripts.train",
        str(spec_path),
    ]


def run_stage(spec: dict[str, Any], nproc: int) -> None:
    """Train with `spec` (see loop.run_from_json) on `nproc` processes;
    `spec["threads"]` is the job's, split between the processes."""
    spec = {**spec, "threads": max(1, spec["threads"] // nproc)}
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
