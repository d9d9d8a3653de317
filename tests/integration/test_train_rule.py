"""The train rule through Snakemake: torchrun with 2 CPU processes, killed and rerun.

Only the train rule runs (`--allowed-rules train`) on synthetic hidden-state shards and a
tiny verifier; nothing upstream, no vLLM.
"""

import shutil
import subprocess
import sys
from pathlib import Path

from devkit.runs import copy_workflow
from devkit.train_inputs import make_train_inputs
from devkit.verifiers import save_tiny_llama
from eagleflow.common.atomic import read_jsonl
from tests.helpers import REPO

OVERRIDES = """\
run: t
verifier: {name: tiny, source: path, path: resources/verifier/tiny}
hidden_states: {num_parts: 2}
train: {nproc_per_node: 2, epochs: 2, batch_tokens: 64, log_every: 1, eval_every: 1, checkpoint_every: 2}
"""

# The ranks' `python -m eagleflow.train` in the test's copy of the workflow.
KILLED_AFTER_STEP_3 = """
import json, os, signal, sys
import torch.distributed as dist
from eagleflow.runtime.logs import configure_logging
from eagleflow.train.loop import run_from_json


def kill_after_step_3(step):
    if step == 3:
        dist.barrier()  # rank 0's checkpoint of step 2 is long complete; both ranks die together
        os.kill(os.getpid(), signal.SIGKILL)


configure_logging(sys.stderr)
run_from_json(json.load(open(sys.argv[1])), kill_after_step_3)
"""


def snakemake(wf: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "snakemake",
            "--cores",
            "2",
            "--allowed-rules",
            "train",
            "--configfile",
            "over.yaml",
            "--",
            "results/t/drafts/default/train/metrics.jsonl",
        ],
        cwd=wf,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_killed_torchrun_job_resumes_on_rerun(tmp_path, clean_env):
    wf = copy_workflow(tmp_path)
    verifier = save_tiny_llama(wf / "resources/verifier/tiny")
    inputs = make_train_inputs(
        wf / "results/t/hidden_states", verifier, [30, 25, 40, 20, 35, 28, 33, 22], [30, 35, 25], draft_vocab=64
    )
    (wf / "results/t/vocab/default").mkdir(parents=True)
    shutil.move(inputs["vocab_map"], wf / "results/t/vocab/default/vocab_map.safetensors")
    (wf / "over.yaml").write_text(OVERRIDES)
    log = wf / "results/t/logs/train.default.log"

    # The copy's package runs (PYTHONPATH), and its ranks kill themselves once step 3 is done.
    env = clean_env | {"PYTHONPATH": str(wf / "workflow")}
    rank_main = wf / "workflow/eagleflow/train/__main__.py"
    rank_main.write_text(KILLED_AFTER_STEP_3)
    killed = snakemake(wf, env)
    assert killed.returncode != 0
    assert "launching 2 training processes" in log.read_text()
    assert (
        not (wf / "results/t/drafts/default/train/metrics.jsonl").exists()
        and not (wf / "results/t/drafts/default/draft").exists()
    )
    (fp_dir,) = [p for p in (wf / "results/t/drafts/default/train/checkpoints").iterdir() if p.is_dir()]
    assert [p.name for p in fp_dir.iterdir()] == ["step-00000002"], "the failed job's checkpoint survives"

    shutil.copy2(REPO / "workflow/eagleflow/train/__main__.py", rank_main)
    done = snakemake(wf, env)
    assert done.returncode == 0, log.read_text()[-4000:]
    assert "resuming from step 2 of 4" in log.read_text()
    rows = read_jsonl(wf / "results/t/drafts/default/train/metrics.jsonl")
    assert [(r["step"], r["split"]) for r in rows] == [(s, split) for s in (1, 2, 3, 4) for split in ("train", "eval")]
    assert (wf / "results/t/drafts/default/draft/model.safetensors").is_file()
    assert not fp_dir.exists()
