"""The quality gate stops the DAG: corrupted synth data never reaches training."""

import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from devkit.configs import config_section
from devkit.runs import copy_workflow
from eagleflow.common.atomic import write_json, write_jsonl
from eagleflow.common.config import typed
from eagleflow.common.replies import write_replies
from eagleflow.dataset import DatasetConfig, QualityGateError, run_dataset
from eagleflow.synth.assemble import parse_completion
from eagleflow.synth.quality import quality_report
from eagleflow.synth.run import SAMPLES


def reasoning_dropped_samples(n: int) -> list[dict]:
    """What the generator that read `reasoning_content` while the server sent `reasoning`
    produced: no reasoning, the verifier's think block lost."""
    samples = []
    for i in range(n):
        # The server sent `reasoning`; the broken generator only looked at `reasoning_content`.
        body = {
            "model": "v",
            "prompt_token_ids": [1, 2, 3],
            "usage": {"prompt_tokens": 3, "completion_tokens": 4},
            "choices": [
                {"message": {"content": f"answer {i}"}, "finish_reason": "stop", "token_ids": [7, 8, 9 + i, 2]}
            ],
        }
        c = parse_completion(body, expect_reasoning=True)
        samples.append(
            {
                "id": f"p{i}#t0",
                "prompt_id": f"p{i}",
                "turn": 0,
                "category": "t",
                "messages": "[]",
                "reasoning": c.reasoning,
                "content": c.content,
                "finish_reason": c.finish_reason,
                "prompt_token_ids": c.prompt_token_ids,
                "completion_token_ids": c.completion_token_ids,
                "prompt_tokens": 3,
                "completion_tokens": 4,
                "server_model": "v",
                "system_fingerprint": None,
                "token_source": "server",
                "defects": c.defects,
            }
        )
    return samples


def write_synth_outputs(d, samples):
    d.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(samples, schema=SAMPLES), d / "responses.parquet")
    write_jsonl(d / "errors.jsonl", [])
    write_json(d / "quality.json", quality_report(samples, [], num_prompts=len(samples)))


GATE = {"max_seq_len": 64, "eval_fraction": 0.2, "max_defect_fraction": {"empty_reasoning": 0.05}}


def test_run_dataset_refuses_and_names_defect_count_and_examples(tmp_path):
    write_synth_outputs(tmp_path, reasoning_dropped_samples(20))
    with pytest.raises(QualityGateError) as exc:
        run_dataset(
            str(tmp_path / "responses.parquet"),
            str(tmp_path / "quality.json"),
            str(tmp_path / "train.parquet"),
            str(tmp_path / "eval.parquet"),
            typed(DatasetConfig, config_section("dataset", **GATE), "dataset"),
        )
    msg = str(exc.value)
    assert "empty_reasoning: 20 samples (100.0%)" in msg and "p0#t0" in msg
    assert not (tmp_path / "train.parquet").exists()


def test_the_gate_stops_the_dag_before_anything_downstream(tmp_path):
    wf = copy_workflow(tmp_path)
    run = wf / "results/gate"
    # Upstream outputs in DAG order (mtimes ascending), as a finished but broken synth left them.
    verifier = wf / "resources/verifier/smollm2-135m-instruct"
    verifier.mkdir(parents=True)
    (verifier / "config.json").write_text(json.dumps({"vocab_size": 64}))
    write_jsonl(run / "prompts/train.jsonl", [{"id": f"p{i}", "turns": ["q"]} for i in range(20)])
    write_jsonl(run / "prompts/eval.jsonl", [{"id": "e0", "turns": ["q"]}])
    for out in ("generate/shards/0-of-1", "generate"):
        write_replies(run / out / "replies.parquet", [])
        write_json(run / out / "stats.json", {})
    write_synth_outputs(run / "synth", reasoning_dropped_samples(20))
    config = {
        "run": "gate",
        "synth": {"expect_reasoning": True},
        "dataset": {"max_defect_fraction": {"empty_reasoning": 0.05}},
    }
    (wf / "gate.yaml").write_text(yaml.safe_dump(config))
    # The drafts' branch of the DAG: the baseline (the verifier alone) does not read the data.
    target = "results/gate/drafts/default/train/metrics.jsonl"
    cmd = [sys.executable, "-m", "snakemake", target, "--cores", "1", "--configfile", "gate.yaml"]
    cmd += ["--rerun-triggers", "mtime"]
    proc = subprocess.run(cmd, cwd=wf, capture_output=True, text=True, timeout=600)
    log = (run / "logs/dataset.log").read_text()
    assert proc.returncode != 0
    assert "quality gate refused" in log and "empty_reasoning: 20 samples (100.0%)" in log
    for downstream in ("dataset/train.parquet", "vocab", "hidden_states", "drafts", "variants", "baseline"):
        assert not (run / downstream).exists(), f"{downstream} was built from refused data"
    assert not (run / "logs/synth.log").exists() and not list((run / "logs").glob("generate*.log")), (
        "synth should not have rerun"
    )
