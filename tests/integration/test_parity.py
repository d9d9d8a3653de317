"""The parity gate against the faults that open a gap between training and serving, on the
shared test run's draft and served streams: an exported draft whose aux layer ids are off by
one, a wrong d2t, prompts served with another chat template, and a draft trained without the
verifier's final norm. Each passes unnoticed by the benchmark alone (vLLM serves the draft
and reports a number; bench/parity_faults.py serves the first two on the demo) and is named
by the parity checks. The tests share one extraction server, as a run's parity jobs do."""

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from devkit.configs import config_section, extraction_section
from eagleflow.benchmark.parity import ParityConfig, ParityError, extraction_job, run_parity
from tests.helpers import REPO, vllm_available

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]

SMALL = yaml.safe_load((REPO / "tests/config/small.yaml").read_text())
WARN = ParityConfig(enabled=True, tolerance=0.03, training_tolerance=0.3, min_target_agreement=0.9, on_gap="warn")


class Run:
    """The shared run's files that a parity job reads."""

    def __init__(self, wf: Path, logs: Path):
        self.wf = wf
        # One log directory for every test's parity job: they attach to one lingering
        # extraction server, as the parity jobs of a run's variants do.
        self.logs = logs
        r = wf / "results/small"
        self.verifier = str(wf / "resources/verifier/smollm2-135m-instruct")
        self.draft = r / "drafts/default/draft"
        self.vocab_map = str(r / "vocab/default/vocab_map.safetensors")
        self.streams = r / "variants/default/benchmark/streams.jsonl"
        self.report = r / "variants/default/benchmark/report.json"
        self.metrics = str(r / "drafts/default/train/metrics.jsonl")
        self.prompts = str(r / "prompts/eval.jsonl")
        self.train = str(r / "dataset/train.parquet")

    def parity(self, tmp: Path, *, draft=None, streams=None, report=None, cfg=WARN, metrics=None) -> dict:
        extraction = extraction_job(
            self.verifier,
            extraction_section(config_section("hidden_states", **SMALL["hidden_states"])),
            None,
            False,
            log_path=str(self.logs / "parity.default.log"),
            threads=2,
            gpus=0,
        )
        return run_parity(
            extraction,
            draft_dir=str(draft or self.draft),
            vocab_map=self.vocab_map,
            streams_path=str(streams or self.streams),
            benchmark_report=str(report or self.report),
            metrics_path=metrics or self.metrics,
            prompts_path=self.prompts,
            train_path=self.train,
            max_model_len=config_section("server")["max_model_len"],
            max_seq_len=config_section("dataset")["max_seq_len"],
            out=str(tmp / "parity.json"),
            chat_template_kwargs={},
            greedy_data=True,
            cfg=cfg,
        )


@pytest.fixture(scope="module")
def run(finished_run, tmp_path_factory):
    return Run(finished_run, tmp_path_factory.mktemp("logs"))


def checks(result: dict) -> set[str]:
    return {f["check"] for f in result["findings"]}


def test_the_shared_runs_parity_job_passed_and_replay_matches_vllm(run):
    parity = json.loads((run.wf / "results/small/variants/default/parity/report.json").read_text())
    assert parity["verdict"] == "pass", parity["findings"]
    assert abs(parity["gap"]) <= parity["tolerance"]
    assert parity["replay"]["num_drafts"] > 0


def test_aux_layer_ids_off_by_one_in_the_exported_draft_are_caught(run, tmp_path):
    """vLLM serves such a draft without a word (bench/parity_faults.py: on the demo it measures
    1.591 against 1.644, a loss nobody would trace); the replay keeps the layers training used,
    and the gate names the fault, and fails the job when configured to."""
    draft = tmp_path / "draft"
    shutil.copytree(run.draft, draft)
    config = json.loads((draft / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in config["eagle_aux_hidden_state_layer_ids"]]
    (draft / "config.json").write_text(json.dumps(config))
    result = run.parity(tmp_path, draft=draft)
    assert "aux_layer_ids" in checks(result), result["findings"]
    with pytest.raises(ParityError, match="aux_layer_ids"):
        run.parity(tmp_path, draft=draft, cfg=dataclasses.replace(WARN, on_gap="fail"))
    assert (run.logs / "parity.default.json").exists(), "a failed gate keeps its report next to its log"


def test_a_wrong_d2t_in_the_exported_draft_is_caught(run, tmp_path):
    draft = tmp_path / "draft"
    shutil.copytree(run.draft, draft)
    weights = load_file(str(draft / "model.safetensors"))
    # Off by one: draft token i maps to draft token i + 1's verifier token (target = i + d2t[i]).
    d2t = weights["d2t"].clone()
    d2t[:-1] = weights["d2t"][1:] + 1
    weights["d2t"] = d2t
    save_file(weights, str(draft / "model.safetensors"), metadata={"format": "pt"})
    result = run.parity(tmp_path, draft=draft)
    assert "d2t" in checks(result), result["findings"]


def test_prompts_served_with_another_chat_template_are_caught(run, tmp_path):
    """The benchmark server applied another template (here: without SmolLM2's default system
    prompt) than synth did for the training data."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(run.verifier)
    prompts = {p["id"]: p for p in map(json.loads, Path(run.prompts).read_text().splitlines())}
    other = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "<|im_start|>assistant\n"
    )
    streams = []
    for s in map(json.loads, run.streams.read_text().splitlines()):
        if s["set"] != "eval":  # the check is on the eval split's prompts
            continue
        messages = [{"role": "user", "content": prompts[s["id"]]["turns"][0]}]
        ids = tokenizer.apply_chat_template(messages, chat_template=other, tokenize=True, add_generation_prompt=False)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        assert ids != s["prompt_token_ids"]
        streams.append({**s, "prompt_token_ids": ids})
    path = tmp_path / "streams.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in streams))
    result = run.parity(tmp_path, streams=path)
    assert "prompt_format" in checks(result), result["findings"]


def test_a_draft_trained_without_the_verifier_norm_is_caught(run, tmp_path, monkeypatch):
    """Training's targets become lm_head(h / rms(h)) instead of lm_head(norm(h)): the draft
    learns tokens the verifier does not produce, and training estimates its acceptance against
    those same targets."""
    from devkit.configs import train_config
    from eagleflow.train import draft as draft_module
    from eagleflow.train.config import TrainJob
    from eagleflow.train.loop import run_train

    # The weight a fresh draft's verifier_norm has when nothing is loaded into it.
    monkeypatch.setattr(draft_module, "load_verifier_final_norm", lambda verifier_dir: torch.ones(576))
    r = run.wf / "results/small"
    job = TrainJob(
        shards=[],
        vocab_map=run.vocab_map,
        index=str(r / "hidden_states/index.json"),
        verifier_dir=run.verifier,
        draft_out=str(tmp_path / "draft"),
        metrics_out=str(tmp_path / "metrics.jsonl"),
        checkpoint_dir=str(tmp_path / "checkpoints"),
        serve_verifier_path=run.verifier,
        threads=2,
    )
    run_train(job, train_config(**{**SMALL["train"], "epochs": 1, "batch_tokens": 1024}))
    # Replay loads the draft's verifier norm from the verifier (as serving never uses it).
    monkeypatch.undo()
    result = run.parity(tmp_path, draft=tmp_path / "draft", metrics=str(tmp_path / "metrics.jsonl"))
    assert "training_targets" in checks(result), result["findings"]
