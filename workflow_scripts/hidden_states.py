"""hidden_states: the verifier's aux-layer and final-layer states for every training token.

Layer convention (vLLM and speculators): an aux layer id `i` is the *input* of decoder
layer i (the residual stream after layers 0..i-1), by default i in (2, L//2, L-3); the
final state is the last layer's output *before* the final norm. The trainer recomputes the
verifier's logits as lm_head(norm(final)). Hooks capture exactly these tensors during the
base model's forward, so no per-layer tuple is kept and no logits are computed.

Each shard is one Snakemake job and one safetensors file, written atomically. Tokens are
stored unpadded: bytes per token = (len(aux) + 1) x hidden x dtype size.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import torch
from tqdm import tqdm

from workflow_scripts.common.atomic import write_json, write_safetensors

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def default_aux_layer_ids(num_layers: int) -> list[int]:
    return [2, num_layers // 2, num_layers - 3]


def resolve_aux_layer_ids(configured: list[int] | None, num_layers: int) -> list[int]:
    ids = list(configured) if configured else default_aux_layer_ids(num_layers)
    if len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) >= num_layers:
        raise ValueError(f"hidden_states.aux_layer_ids {ids} must be distinct layer indices in 0..{num_layers - 1}")
    return ids


class StateCapture:
    """Forward hooks that record the inputs of the aux layers and of the final norm."""

    def __init__(self, base_model: torch.nn.Module, aux_layer_ids: list[int]):
        self.aux: dict[int, torch.Tensor] = {}
        self.final: torch.Tensor | None = None
        self._handles = []
        for i in aux_layer_ids:
            self._handles.append(base_model.layers[i].register_forward_pre_hook(self._aux_hook(i), with_kwargs=True))
        self._handles.append(base_model.norm.register_forward_pre_hook(self._final_hook))
        self.aux_layer_ids = aux_layer_ids

    def _aux_hook(self, i: int):
        def hook(module, args, kwargs):
            self.aux[i] = args[0] if args else kwargs["hidden_states"]

        return hook

    def _final_hook(self, module, args):
        self.final = args[0]

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux states concatenated on the last dim in aux_layer_ids order, final pre-norm state)."""
        aux = torch.cat([self.aux[i] for i in self.aux_layer_ids], dim=-1)
        final = self.final
        self.aux, self.final = {}, None
        return aux, final

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def token_budget_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Group sample indices (sorted by length) so that padded batch size stays within the budget. Pure."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches, current = [], []
    for i in order:
        if current and (len(current) + 1) * lengths[i] > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def load_verifier(verifier_dir: str, device: str, compute_dtype: torch.dtype, trust_remote_code: bool = False):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        verifier_dir, dtype=compute_dtype, trust_remote_code=trust_remote_code, attn_implementation="sdpa"
    )
    return model.to(device).eval()


def samples_for_shard(train: str, eval_: str, shard: int, num_shards: int) -> list[dict[str, Any]]:
    rows = []
    for split, path in (("train", train), ("eval", eval_)):
        for r in pq.read_table(path, columns=["id", "input_ids", "loss_mask"]).to_pylist():
            rows.append({**r, "split": split})
    rows.sort(key=lambda r: r["id"])
    return rows[shard::num_shards]


def check_disk_space(out_dir: Path, num_tokens: int, num_states: int, hidden_size: int, dtype: torch.dtype) -> int:
    need = num_tokens * num_states * hidden_size * torch.empty((), dtype=dtype).element_size()
    out_dir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out_dir).free
    log.info("will write %.2f MB (%d tokens x %d states x %d hidden x %s); %.1f GB free", need / 1e6, num_tokens, num_states, hidden_size, dtype, free / 1e9)
    if need > free:
        raise OSError(f"{out_dir}: hidden states need {need} bytes but only {free} are free")
    return need


@torch.inference_mode()
def extract(model, samples: list[dict[str, Any]], aux_layer_ids: list[int], batch_tokens: int, store_dtype: torch.dtype, pad_id: int = 0):
    """Run the verifier over `samples`; return per-sample (aux, final) tensors in sample order."""
    base = model.model
    capture = StateCapture(base, aux_layer_ids)
    device = next(model.parameters()).device
    out: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(samples)
    lengths = [len(s["input_ids"]) for s in samples]
    try:
        bar = tqdm(total=sum(lengths), desc="hidden states", unit="tok", unit_scale=True, mininterval=2.0)
        for batch in token_budget_batches(lengths, batch_tokens):
            width = max(lengths[i] for i in batch)
            ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, i in enumerate(batch):
                ids[row, : lengths[i]] = torch.tensor(samples[i]["input_ids"])
                mask[row, : lengths[i]] = 1
            base(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)
            aux, final = capture.take()
            for row, i in enumerate(batch):
                out[i] = (aux[row, : lengths[i]].to("cpu", store_dtype), final[row, : lengths[i]].to("cpu", store_dtype))
            bar.update(sum(lengths[i] for i in batch))
        bar.close()
    finally:
        capture.remove()
    return out


def run_shard(
    train: str, eval_: str, verifier_dir: str, shard: int, num_shards: int, out: str, *,
    aux_layer_ids: list[int] | None, batch_tokens: int, dtype: str, device: str, threads: int,
    trust_remote_code: bool = False,
) -> None:  # fmt: skip
    torch.set_num_threads(threads)
    samples = samples_for_shard(train, eval_, shard, num_shards)
    if not samples:
        raise ValueError(f"shard {shard} of {num_shards} has no samples: lower hidden_states.num_shards")
    # Compute in float32 on CPU (bf16 matmuls take slow paths on CPUs without bf16 units);
    # store in the configured dtype.
    compute_dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = load_verifier(verifier_dir, device, compute_dtype, trust_remote_code)
    num_layers = model.config.num_hidden_layers
    layer_ids = resolve_aux_layer_ids(aux_layer_ids, num_layers)
    hidden = model.config.hidden_size
    num_tokens = sum(len(s["input_ids"]) for s in samples)
    check_disk_space(Path(out).parent, num_tokens, len(layer_ids) + 1, hidden, DTYPES[dtype])
    states = extract(model, samples, layer_ids, batch_tokens, DTYPES[dtype], pad_id=model.config.pad_token_id or 0)
    offsets = [0]
    for s in samples:
        offsets.append(offsets[-1] + len(s["input_ids"]))
    tensors = {
        "hidden_states": torch.cat([a for a, _ in states]),
        "verifier_last_hidden_states": torch.cat([f for _, f in states]),
        "input_ids": torch.tensor([t for s in samples for t in s["input_ids"]], dtype=torch.int32),
        "loss_mask": torch.tensor([t for s in samples for t in s["loss_mask"]], dtype=torch.int8),
        "offsets": torch.tensor(offsets, dtype=torch.int64),
        "is_eval": torch.tensor([s["split"] == "eval" for s in samples], dtype=torch.bool),
    }
    metadata = {
        "sample_ids": json.dumps([s["id"] for s in samples]),
        "aux_layer_ids": json.dumps(layer_ids),
        "num_layers": str(num_layers),
        "hidden_size": str(hidden),
        "convention": "aux i = input of decoder layer i; final = last layer output before final norm",
    }
    write_safetensors(out, tensors, metadata)
    log.info("shard %d/%d: %d samples, %d tokens -> %s", shard, num_shards, len(samples), num_tokens, out)


def read_shard_header(path: str) -> dict[str, Any]:
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
        return {
            "path": Path(path).name,
            "num_samples": len(json.loads(meta["sample_ids"])),
            "num_tokens": f.get_slice("input_ids").get_shape()[0],
            "aux_layer_ids": json.loads(meta["aux_layer_ids"]),
            "num_layers": int(meta["num_layers"]),
            "hidden_size": int(meta["hidden_size"]),
            "dtype": str(f.get_slice("hidden_states").get_dtype()),
        }


def write_index(shards: list[str], verifier_dir: str, out: str) -> None:
    headers = [read_shard_header(s) for s in shards]
    first = headers[0]
    for h in headers[1:]:
        for key in ("aux_layer_ids", "num_layers", "hidden_size", "dtype"):
            if h[key] != first[key]:
                raise ValueError(f"shard {h['path']} has {key}={h[key]}, shard {first['path']} has {first[key]}: rerun the stale shard")
    write_json(out, {
        "verifier": verifier_dir,
        "aux_layer_ids": first["aux_layer_ids"],
        "num_layers": first["num_layers"],
        "hidden_size": first["hidden_size"],
        "dtype": first["dtype"],
        "convention": "aux i = input of decoder layer i (vLLM/speculators); final = last layer output before the final norm",
        "num_samples": sum(h["num_samples"] for h in headers),
        "num_tokens": sum(h["num_tokens"] for h in headers),
        "shards": headers,
    })  # fmt: skip
