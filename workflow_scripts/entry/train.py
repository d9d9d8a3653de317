import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from workflow_scripts.common.atomic import write_text
from workflow_scripts.common.smk import stage
from workflow_scripts.train.loop import run_from_json

with stage(snakemake) as log:  # noqa: F821 (injected by Snakemake)
    smk = snakemake  # noqa: F821
    nproc = smk.params.train.get("nproc_per_node", 1)
    spec = {
        "shards": list(smk.input.shards), "vocab_map": smk.input.vocab_map, "index": smk.input.index,
        "verifier_dir": smk.input.verifier, "draft_out": smk.output.draft, "metrics_out": smk.output.metrics,
        "checkpoint_dir": smk.params.checkpoint_dir, "serve_verifier_path": smk.params.serve_verifier_path,
        "cfg": smk.params.train, "threads": max(1, smk.threads // nproc),
    }  # fmt: skip
    if nproc == 1:
        run_from_json(spec)
    else:
        # Data parallel: torchrun starts nproc copies of the same loop. It runs in its own
        # process group, killed as a whole on every exit path (SIGTERM from Snakemake included).
        spec_path = Path(smk.params.checkpoint_dir) / "torchrun-spec.json"
        write_text(spec_path, json.dumps(spec))
        repo = str(Path(__file__).resolve().parents[2])
        env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "-m", "workflow_scripts.train", str(spec_path)]  # fmt: skip
        log.info("launching %s", " ".join(cmd))
        proc = subprocess.Popen(cmd, env=env, stdout=sys.stderr, stderr=sys.stderr, start_new_session=True)
        try:
            rc = proc.wait()
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        if rc != 0:
            raise RuntimeError(f"torchrun ({nproc} processes) exited with {rc}; see the rank logs above")
