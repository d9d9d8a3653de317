"""What vLLM cannot serve is refused before a launch, with the setting and the fix named."""

import json

import pytest
import torch
from safetensors.torch import save_file

from devkit.configs import server_config
from eagleflow.common.verifier_config import (
    CPU_MLA_ROPE_ARGS,
    safetensors_weight_map,
    served_as_deepseek,
    vllm_serving_problems,
)
from eagleflow.runtime.spec import ServerError, ServerSpec
from eagleflow.runtime.vllm_cpu import (
    common_block_size,
    cpu_attention_backend,
    cpu_has_amx,
    draft_backend_problem,
    requested_attention_backend,
)

DEEPSEEK_V3 = {
    "model_type": "deepseek_v3",
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "n_routed_experts": 256,
    "topk_method": "noaux_tc",
}
BIAS = {"model.layers.3.mlp.gate.e_score_correction_bias", "model.layers.3.mlp.gate.weight"}


def test_mla_in_float32_and_routing_without_noaux_tc_are_named():
    assert vllm_serving_problems(DEEPSEEK_V3, "bfloat16", BIAS) == []
    (problem,) = vllm_serving_problems(DEEPSEEK_V3, "float32", BIAS)
    assert "MLA" in problem and "server.dtype: bfloat16" in problem
    no_method = {k: v for k, v in DEEPSEEK_V3.items() if k != "topk_method"}
    (problem,) = vllm_serving_problems(no_method, "bfloat16", BIAS)
    assert "topk_method: noaux_tc" in problem and "KeyError" in problem
    # Without the bias in the checkpoint (DeepSeek-V2 routing), any method serves.
    assert vllm_serving_problems(no_method, "bfloat16", {"model.layers.3.mlp.gate.weight"}) == []
    assert vllm_serving_problems({"model_type": "llama"}, "float32", set()) == []
    (problem,) = vllm_serving_problems({**DEEPSEEK_V3, "kv_lora_rank": 32}, "bfloat16", BIAS)
    assert "96" in problem and "576" in problem


def test_mla_on_vllm_cpu_needs_the_native_rope():
    (problem,) = vllm_serving_problems(DEEPSEEK_V3, "bfloat16", BIAS, vllm_cpu=True)
    assert "rotary" in problem and "-rotary_embedding" in problem
    assert vllm_serving_problems(DEEPSEEK_V3, "bfloat16", BIAS, CPU_MLA_ROPE_ARGS, vllm_cpu=True) == []
    assert vllm_serving_problems(DEEPSEEK_V3, "bfloat16", BIAS, vllm_cpu=False) == []
    assert vllm_serving_problems({"model_type": "llama"}, "bfloat16", set(), vllm_cpu=True) == []


def test_deepseek_code_is_recognised_by_model_type_or_architecture():
    assert served_as_deepseek({"model_type": "deepseek_v3"})
    assert served_as_deepseek({"model_type": "kimi_k2", "architectures": ["KimiK2ForCausalLM"]})
    assert served_as_deepseek({"model_type": "custom", "architectures": ["DeepseekV3ForCausalLM"]})
    assert not served_as_deepseek({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})


def test_tensor_names_come_from_the_index_or_the_headers(tmp_path):
    save_file({"a.weight": torch.zeros(2), "b.e_score_correction_bias": torch.zeros(2)}, tmp_path / "model.safetensors")
    assert set(safetensors_weight_map(tmp_path)) == {"a.weight", "b.e_score_correction_bias"}
    index = {"weight_map": {"x": "model-00001.safetensors", "y": "model-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert set(safetensors_weight_map(tmp_path)) == {"x", "y"}


def test_the_launcher_refuses_before_starting_a_process(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V3))
    save_file({name: torch.zeros(2) for name in BIAS}, tmp_path / "model.safetensors")
    with pytest.raises(ServerError, match="float32"):
        ServerSpec.from_config(
            server_config(dtype="float32", extra_args=list(CPU_MLA_ROPE_ARGS)), str(tmp_path)
        ).check()
    ServerSpec.from_config(server_config(dtype="bfloat16", extra_args=list(CPU_MLA_ROPE_ARGS)), str(tmp_path)).check()


def test_vllm_cpu_picks_the_mla_backend_by_amx_and_request():
    assert cpu_attention_backend(mla=False, amx=True) == "CPU_ATTN"
    assert cpu_attention_backend(mla=True, amx=True) == "AMX_MLA"
    assert cpu_attention_backend(mla=True, amx=False) == "CPU_MLA"
    assert cpu_attention_backend(mla=True, amx=True, requested="CPU_MLA") == "CPU_MLA"
    assert requested_attention_backend(["--x", "1", "--attention-backend", "cpu_mla"]) == "CPU_MLA"
    assert requested_attention_backend(["--attention-backend=AMX_MLA"]) == "AMX_MLA"
    assert requested_attention_backend(["--attention-backend"]) is None


def test_block_sizes_common_to_the_backends():
    assert common_block_size(["CPU_ATTN", "AMX_MLA"]) == 32
    assert common_block_size(["CPU_MLA", "CPU_MLA"]) == 16
    assert common_block_size(["CPU_ATTN", "CPU_MLA"]) is None  # 16 only against multiples of 32
    assert common_block_size(["CPU_ATTN"]) == 32


@pytest.mark.parametrize("amx", [True, False])
def test_a_llama_draft_beside_an_mla_verifier_fits_only_with_amx(amx):
    llama_problem = draft_backend_problem(DEEPSEEK_V3, "llama", [], amx)
    assert (llama_problem is None) == amx
    if llama_problem:
        assert "train.draft_attention: llama" in llama_problem and "set train.draft_attention: mla" in llama_problem
        assert "CPU_MLA" in llama_problem and "CPU_ATTN" in llama_problem
    # The MLA draft shares the verifier's backend; a non-MLA verifier fits a Llama draft anywhere.
    assert draft_backend_problem(DEEPSEEK_V3, "mla", [], amx) is None
    assert draft_backend_problem({"model_type": "llama"}, "llama", [], amx) is None
    # Asking for CPU_MLA by name takes the AMX backend away on any machine.
    assert draft_backend_problem(DEEPSEEK_V3, "llama", ["--attention-backend", "CPU_MLA"], amx) is not None


def test_amx_is_read_from_the_cpu_flags(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n")
    assert cpu_has_amx(str(info))
    info.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 avx512_vnni\n")
    assert not cpu_has_amx(str(info))
    assert not cpu_has_amx(str(tmp_path / "missing"))
