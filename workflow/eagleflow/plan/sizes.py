"""The plan's sizes (eagleflow.plan): the verifier's weights, the draft's parameters
and its training memory, free disk and GPU memory on this machine."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagleflow.common.cache_keys import nvidia_smi
from eagleflow.common.verifier_config import draft_attention_geometry, text_config


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


# speculators' defaults the plan sizes a method with (eagleflow leaves them as they are).
DSPARK_MARKOV_RANK = 256
MAX_ANCHORS = {"dflash": 512, "dflash2": 512, "dspark": 3072}
# DFlash2: each layer's two grouped dynamic convolutions (kernel taps, channels sharing a kernel)
# and the candidate selector's rank.
DFLASH2_CONV_KERNEL, DFLASH2_CONV_GROUP, DFLASH2_SELECTOR_RANK = 2, 16, 256
BLOCK_DRAFTERS = ("dflash", "dflash2", "dspark")
PEAGLE_DOWN_SAMPLE = (0.7, 0.2)  # COD sampling: depth d keeps max(0.7^d, 0.2) of the positions


def draft_params(g: Geometry, train: dict[str, Any], draft_vocab: int, num_aux: int) -> tuple[int, int]:
    """(trainable, frozen) parameters of the draft eagleflow trains for `train` (its method and
    layers; train/methods.py). Pure.

    EAGLE-3: the fc over the aux states, `num_layers` Llama layers (the first takes [embedding;
    state], 2 x hidden, and normalises the state with its own norm) and the final norm; frozen:
    the verifier's embeddings, the draft lm_head and the verifier's lm_head rows of the draft
    vocabulary (both initialised from the verifier's), the verifier's final norm. P-EAGLE: the
    same with the embeddings trained and a learned mask state. DFlash: the fc and its norm,
    Qwen3 layers of hidden-size input (q and k norms of head_dim), the final norm; DSpark adds
    its Markov bias (vocabulary x rank x draft vocabulary) and confidence head; DFlash2 two
    convolutions a layer (base kernels and their projection from the state) and the candidate
    selector (two vocabulary x rank codebooks and a hidden x rank projection)."""
    h, q, kv, num_layers = g.hidden_size, g.num_heads * g.head_dim, g.num_kv_heads * g.head_dim, train["num_layers"]
    method = train["method"]
    mlp = 3 * h * g.intermediate_size
    frozen = g.vocab_size * h + 2 * draft_vocab * h + h
    if method in BLOCK_DRAFTERS:
        layers = num_layers * (h * (q + 2 * kv) + q * h + 2 * g.head_dim + mlp + 2 * h)
        trainable = num_aux * h * h + h + layers + h  # fc, its norm, the layers, the final norm
        if method == "dspark":
            trainable += DSPARK_MARKOV_RANK * (g.vocab_size + draft_vocab) + h + DSPARK_MARKOV_RANK + 1
        if method == "dflash2":
            taps = 2 * DFLASH2_CONV_KERNEL
            trainable += num_layers * 2 * (taps * h + h * taps * (h // DFLASH2_CONV_GROUP))
            trainable += DFLASH2_SELECTOR_RANK * (2 * draft_vocab + h)
        return trainable, frozen
    layer_in = [2 * h] + [h] * (num_layers - 1)
    layers = sum(i * (q + 2 * kv) + q * h + mlp + 2 * h for i in layer_in)
    trainable = num_aux * h * h + layers + h + h  # + the first layer's state norm, the final norm
    if method == "peagle":
        return trainable + g.vocab_size * h + num_aux * h, frozen - g.vocab_size * h
    return trainable, frozen


def adamw_params(g: Geometry, train: dict[str, Any], num_aux: int) -> int:
    """The draft's trainable parameters Muon does not take (train.optimizer.takes_muon), which
    AdamW updates: the norms (two a layer, the first layer's state norm or DFlash's fc norm, the
    final norm), DFlash's q and k norms, P-EAGLE's embeddings and mask state, DSpark's confidence
    head, DFlash2's base kernels and the selector's codebooks. Pure."""
    h, num_layers, method = g.hidden_size, train["num_layers"], train["method"]
    vectors = (2 * num_layers + 2) * h
    if method == "peagle":
        return vectors + g.vocab_size * h + num_aux * h
    if method in BLOCK_DRAFTERS:
        vectors += num_layers * 2 * g.head_dim
        if method == "dflash2":  # its draft vocabulary is the whole one
            vectors += num_layers * 2 * 2 * DFLASH2_CONV_KERNEL * h + 2 * DFLASH2_SELECTOR_RANK * g.vocab_size
        return vectors + (h + DSPARK_MARKOV_RANK + 1 if method == "dspark" else 0)
    return vectors


def optimizer_state_floats(g: Geometry, train: dict[str, Any], trainable: int, num_aux: int) -> int:
    """float32 values of the optimizer's state (train.optimizer) for `trainable` parameters:
    AdamW keeps two moments of every tensor, Muon one momentum buffer of each matrix and
    AdamW's two moments of the rest (adamw_params). Pure."""
    if train["optimizer"] == "adamw":
        return 2 * trainable
    rest = adamw_params(g, train, num_aux)
    return (trainable - rest) + 2 * rest


def draft_positions(train: dict[str, Any]) -> float:
    """Positions a training batch of `batch_tokens` runs the draft's layers on: EAGLE-3's chain
    of ttt_steps over every token; P-EAGLE's COD samples (every token at depth 0, then a
    decaying share); a block drafter's anchors (up to speculators' max_anchors) times the block.
    Pure."""
    tokens, method = train["batch_tokens"], train["method"]
    if method == "peagle":
        ratio, floor = PEAGLE_DOWN_SAMPLE
        return tokens * (1 + sum(max(ratio**d, floor) for d in range(1, train["num_depths"])))
    if method in MAX_ANCHORS:
        return min(tokens, MAX_ANCHORS[method]) * train["block_size"]
    return tokens * train["ttt_steps"]


def draft_export_bytes(g: Geometry, trainable: int, draft_vocab: int, method: str = "eagle3") -> int:
    """The exported draft's model.safetensors: the trainable weights, the embeddings (EAGLE-3's
    frozen ones; P-EAGLE's are trained, DFlash and DSpark save none) and the draft lm_head in
    bf16, and the vocabulary maps (d2t int64, t2d bool). DFlash2 drafts over the whole
    vocabulary: no lm_head and no maps, vLLM takes the verifier's head. Pure."""
    if method == "dflash2":
        return trainable * 2
    embeddings = g.vocab_size * g.hidden_size if method == "eagle3" else 0
    return (trainable + embeddings + draft_vocab * g.hidden_size) * 2 + draft_vocab * 8 + g.vocab_size


def draft_train_bytes(g: Geometry, train: dict[str, Any], draft_vocab: int, num_aux: int) -> dict[str, int]:
    """GPU memory of one training process, estimated. Pure.

    fp32 master weights, gradients and the optimizer's state (train.optimizer: AdamW's two
    moments, or Muon's one momentum buffer of each matrix), fp32 frozen weights, and per
    position the draft runs on (draft_positions): the layers' activations (fp32) and the
    draft-vocabulary logits with their softmax and gradient."""
    trainable, frozen = draft_params(g, train, draft_vocab, num_aux)
    # weights, gradients, the optimizer's state
    per_trainable = 4 * (2 * trainable + optimizer_state_floats(g, train, trainable, num_aux))
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
