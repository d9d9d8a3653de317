"""The plan's sizes (eagleflow.plan): the verifier's weights, the draft's parameters
and its training memory, free disk and GPU memory on this machine."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import shutil
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from eagleflow.common.atomic import write_json
from eagleflow.common.cache_keys import nvidia_smi, software
from eagleflow.common.fingerprint import code_fingerprint
from eagleflow.common.identity import digest_cache_path
from eagleflow.common.verifier_config import draft_attention_geometry, text_config

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Geometry:
    """The verifier's shape, from its config.json."""

    hidden_size: int
    num_layers: int
    vocab_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    text: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)  # its text config

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Geometry:
        v = text_config(config)
        heads, kv_heads, head_dim = draft_attention_geometry(v)
        return cls(
            int(v["hidden_size"]),
            int(v["num_hidden_layers"]),
            int(v["vocab_size"]),
            int(v["intermediate_size"]),
            heads,
            kv_heads,
            head_dim,
            dict(v),
        )


def weight_bytes_on_disk(verifier_dir: Path) -> int | None:
    """The verifier's weights: the sharded index's total, or the safetensors files' sizes."""
    index = verifier_dir / "model.safetensors.index.json"
    if index.exists():
        total = json.loads(index.read_text()).get("metadata", {}).get("total_size")
        if total:
            return int(total)
    files = list(verifier_dir.glob("*.safetensors"))
    return sum(f.stat().st_size for f in files) if files else None


def estimated_weight_bytes(config: dict[str, Any]) -> int:
    """The verifier's weights from its config.json: Llama-style dense or DeepSeek-V3-style
    (MLA attention, MoE), in bf16, with routed experts at the quantization config's bits
    (plus a bf16 scale per group). Pure; an estimate within a few percent for these families."""
    v = text_config(config)
    h, layers, vocab = v["hidden_size"], v["num_hidden_layers"], v["vocab_size"]
    heads = v["num_attention_heads"]
    if v.get("kv_lora_rank"):
        qk = v["qk_nope_head_dim"] + v["qk_rope_head_dim"]
        q = h * heads * qk if not v.get("q_lora_rank") else h * v["q_lora_rank"] + v["q_lora_rank"] * heads * qk
        kv = h * (v["kv_lora_rank"] + v["qk_rope_head_dim"])
        kv += v["kv_lora_rank"] * heads * (v["qk_nope_head_dim"] + v["v_head_dim"])
        attn = q + kv + heads * v["v_head_dim"] * h
    else:
        head_dim = v.get("head_dim") or h // heads
        kv_heads = v.get("num_key_value_heads") or heads
        attn = h * head_dim * (2 * heads + 2 * kv_heads)
    dense_mlp = 3 * h * v["intermediate_size"]
    experts = v.get("n_routed_experts") or 0
    moe_layers = 0
    if experts:
        first_dense, every = v.get("first_k_dense_replace", 0), v.get("moe_layer_freq", 1)
        moe_layers = sum(1 for i in range(first_dense, layers) if i % every == 0)
    expert_mlp = 3 * h * (v.get("moe_intermediate_size") or 0)
    shared = (v.get("n_shared_experts") or 0) * expert_mlp + experts * h  # shared experts and the router
    embeddings = (1 if v.get("tie_word_embeddings") else 2) * vocab * h
    bf16 = layers * attn + (layers - moe_layers) * dense_mlp + moe_layers * shared + embeddings
    routed = moe_layers * experts * expert_mlp
    bits, group = quantization(config)
    return int(bf16 * 2 + routed * (bits / 8 + (2 / group if group else 0)))


def quantization(config: dict[str, Any]) -> tuple[int, int]:
    """(bits, group size) of the quantized weights, (16, 0) when none. Pure."""
    q = config.get("quantization_config") or text_config(config).get("quantization_config") or {}
    for group in (q.get("config_groups") or {}).values():
        weights = group.get("weights") or {}
        if weights.get("num_bits"):
            return int(weights["num_bits"]), int(weights.get("group_size") or 0)
    if q.get("bits"):
        return int(q["bits"]), int(q.get("group_size") or 0)
    return 16, 0


@dataclass(frozen=True)
class DraftSizes:
    """What the plan reads of the draft eagleflow trains: its parameters, trainable and frozen;
    the trainable ones AdamW updates when Muon takes the matrices (train.optimizer.takes_muon:
    the norms, embeddings and other vectors, the vocabulary's matrices); the bytes of its
    exported model.safetensors."""

    trainable: int
    frozen: int
    adamw: int
    export_bytes: int


def draft_sizes(g: Geometry, train: dict[str, Any], draft_vocab: int, num_aux: int) -> DraftSizes:
    """DraftSizes of the draft `train` (its method and layers) trains, counted on the draft its
    method builds, on the meta device (shapes only, no memory, no verifier weights)."""
    return _counted(json.dumps(g.text, sort_keys=True), json.dumps(train, sort_keys=True), draft_vocab, num_aux)


@cache
def _counted(verifier: str, train: str, draft_vocab: int, num_aux: int) -> DraftSizes:
    """DraftSizes as remembered beside the file digests (remembered_sizes_path), else
    counted (_count) and remembered. Counting imports speculators and builds the draft: about
    13 s of CPU, in every `snakemake` call that plans a train job; what it counts follows from
    the arguments, the draft methods' code and the installed libraries, and all of them key it."""
    # A method registered from outside the package (a test's toy) is in no fingerprint: counted.
    path = remembered_sizes_path() if _shipped(json.loads(train)) else None
    if path is None:
        return _count(verifier, train, draft_vocab, num_aux)
    key = _sizes_key(verifier, train, draft_vocab, num_aux)
    entry = _read_remembered(path).get(key)
    if isinstance(entry, dict) and set(entry) == {f.name for f in dataclasses.fields(DraftSizes)}:
        return DraftSizes(**entry)
    sizes = _count(verifier, train, draft_vocab, num_aux)
    _remember(path, key, sizes)
    return sizes


def remembered_sizes_path() -> Path | None:
    """`draft-sizes.json` beside the remembered file digests (common.identity:
    digest_cache_path; None where nothing is remembered)."""
    digests = digest_cache_path()
    return digests.with_name("draft-sizes.json") if digests else None


def _shipped(train: dict[str, Any]) -> bool:
    from eagleflow.train.methods import draft_method

    return type(draft_method(train["method"])).__module__.startswith("eagleflow.")


def _sizes_key(verifier: str, train: str, draft_vocab: int, num_aux: int) -> str:
    libraries = software(("torch", "transformers", "speculators"))
    code = code_fingerprint(__name__)  # this module and what it imports: the methods, their drafts
    return hashlib.sha256(json.dumps([verifier, train, draft_vocab, num_aux, code, libraries]).encode()).hexdigest()


def _read_remembered(path: Path) -> dict[str, Any]:
    """The remembered sizes; empty, with a warning, where the file is unreadable or corrupt
    (it is rewritten): remembering saves time, it never stops a plan."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("%s: cannot read the remembered draft sizes (%s): counting again", path, exc)
        return {}
    return data if isinstance(data, dict) else {}


def _remember(path: Path, key: str, sizes: DraftSizes) -> None:
    """Add one entry, read again just before the atomic write: plans writing at once lose at
    most each other's newest entry, never the file. A file that cannot be written is a warning."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, {**_read_remembered(path), key: dataclasses.asdict(sizes)})
    except OSError as exc:
        log.warning("%s: cannot remember the draft sizes (%s): the next plan counts again", path, exc)


def _count(verifier: str, train: str, draft_vocab: int, num_aux: int) -> DraftSizes:
    from eagleflow.common.config import typed
    from eagleflow.train.config import TrainConfig
    from eagleflow.train.methods import draft_method
    from eagleflow.train.optimizer import takes_muon

    cfg = typed(TrainConfig, json.loads(train), "train")
    method = draft_method(cfg.method)
    draft = method.meta_draft(json.loads(verifier), cfg, draft_vocab, num_aux)
    params = dict(draft.named_parameters())
    trainable = {n: p for n, p in params.items() if p.requires_grad}
    exported = method.exported(draft, draft.state_dict())
    # Floating-point tensors are stored in bfloat16 (train.draft.export_draft), the rest as they are.
    stored = sum(t.numel() * (2 if t.is_floating_point() else t.element_size()) for t in exported.values())
    return DraftSizes(
        trainable=sum(p.numel() for p in trainable.values()),
        frozen=sum(p.numel() for p in params.values() if not p.requires_grad),
        adamw=sum(p.numel() for n, p in trainable.items() if not takes_muon(n, p)),
        export_bytes=stored,
    )


def draft_params(g: Geometry, train: dict[str, Any], draft_vocab: int, num_aux: int) -> tuple[int, int]:
    """(trainable, frozen) parameters of the draft eagleflow trains for `train` (draft_sizes)."""
    sizes = draft_sizes(g, train, draft_vocab, num_aux)
    return sizes.trainable, sizes.frozen


def optimizer_state_floats(g: Geometry, train: dict[str, Any], draft_vocab: int, num_aux: int) -> int:
    """float32 values of the optimizer's state (train.optimizer) for the draft's trainable
    parameters: AdamW keeps two moments of every tensor, Muon one momentum buffer of each
    matrix and AdamW's two moments of the rest (DraftSizes.adamw)."""
    sizes = draft_sizes(g, train, draft_vocab, num_aux)
    if train["optimizer"] == "adamw":
        return 2 * sizes.trainable
    return (sizes.trainable - sizes.adamw) + 2 * sizes.adamw


def draft_positions(train: dict[str, Any]) -> float:
    """Positions a training batch of `batch_tokens` runs the draft's layers on, as its method
    samples them (DraftMethod.positions_per_batch)."""
    from eagleflow.common.config import typed
    from eagleflow.train.config import TrainConfig
    from eagleflow.train.methods import draft_method

    cfg = typed(TrainConfig, train, "train")
    return draft_method(cfg.method).positions_per_batch(cfg)


def draft_export_bytes(g: Geometry, train: dict[str, Any], draft_vocab: int, num_aux: int) -> int:
    """The exported draft's model.safetensors (draft_sizes), less its header."""
    return draft_sizes(g, train, draft_vocab, num_aux).export_bytes


def draft_train_bytes(g: Geometry, train: dict[str, Any], draft_vocab: int, num_aux: int) -> dict[str, int]:
    """GPU memory of one training process, estimated.

    fp32 master weights, gradients and the optimizer's state (train.optimizer: AdamW's two
    moments, or Muon's one momentum buffer of each matrix), fp32 frozen weights, and per
    position the draft runs on (draft_positions): the layers' activations (fp32) and the
    draft-vocabulary logits with their softmax and gradient."""
    trainable, frozen = draft_params(g, train, draft_vocab, num_aux)
    # weights, gradients, the optimizer's state
    per_trainable = 4 * (2 * trainable + optimizer_state_floats(g, train, draft_vocab, num_aux))
    h, i = g.hidden_size, g.intermediate_size
    per_token = (num_aux * h + train["num_layers"] * (12 * h + 3 * g.num_heads * g.head_dim + 3 * i)) * 4
    per_token += 3 * draft_vocab * 4
    activations = int(draft_positions(train) * per_token)
    return {
        "trainable": trainable,
        "frozen": frozen,
        "state": per_trainable + 4 * frozen,
        "activations": activations,
        "total": per_trainable + 4 * frozen + activations,
    }


def free_bytes(path: Path) -> int:
    """Free space on the file system `path` will land on (its nearest existing ancestor)."""
    p = path.absolute()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def gpu_memory_bytes() -> int | None:
    """The smallest visible GPU's memory, from nvidia-smi; None without GPUs."""
    sizes = [int(x) * 2**20 for x in nvidia_smi("memory.total")]
    return min(sizes) if sizes else None


def gpu_count() -> int | None:
    """The GPUs nvidia-smi sees here; None without GPUs."""
    return len(nvidia_smi("memory.total")) or None
