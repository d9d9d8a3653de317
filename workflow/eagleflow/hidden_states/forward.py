"""The verifier's forward with hooks (the `hf` backend's, and online training's): transformers
on CPU, one GPU, or several with `device: auto`, batched by token budget. Hooks record the aux
layers' inputs and the final norm's input during the base model's forward, so no per-layer
tuple is kept and no logits are computed."""

from __future__ import annotations

import logging
from typing import Any

import torch
from tqdm import tqdm

from eagleflow.common.verifier_config import text_config
from eagleflow.hidden_states.layers import States
from eagleflow.hidden_states.storage import torch_dtype

log = logging.getLogger(__name__)


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


def decoder_parts(
    model: torch.nn.Module, num_layers: int
) -> tuple[torch.nn.Module, torch.nn.ModuleList, torch.nn.Module]:
    """(base model, its decoder layers, its final norm), wherever the architecture keeps them.

    Llama and Qwen3 use `model.layers` / `model.norm`; a multimodal wrapper such as
    Kimi-K2.5 nests them under `language_model`; GPT-style code calls them `h` / `ln_f`.
    The decoder stack is the shallowest ModuleList with exactly `num_layers` entries; the
    final norm is the sibling module named like a norm; the base model is their parent.
    """
    candidates = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.ModuleList) and len(module) == num_layers
    ]
    if not candidates:
        raise ValueError(f"{type(model).__name__}: no ModuleList of {num_layers} decoder layers found")
    layers_name, layers = min(candidates, key=lambda c: c[0].count("."))
    parent_name = layers_name.rpartition(".")[0]
    base = model.get_submodule(parent_name) if parent_name else model
    for norm_name in ("norm", "final_layernorm", "final_norm", "ln_f", "norm_f"):
        norm = getattr(base, norm_name, None)
        if isinstance(norm, torch.nn.Module):
            return base, layers, norm
    raise ValueError(f"{type(base).__name__} ({parent_name or 'top level'}): no final norm next to {layers_name}")


class StateCapture:
    """Forward hooks that record the inputs of the aux layers and of the final norm."""

    def __init__(self, layers: torch.nn.ModuleList, norm: torch.nn.Module, aux_layer_ids: list[int]):
        self.aux: dict[int, torch.Tensor] = {}
        self.final: torch.Tensor | None = None
        self.aux_layer_ids = aux_layer_ids
        self._handles = [
            layers[i].register_forward_pre_hook(self._aux_hook(i), with_kwargs=True) for i in aux_layer_ids
        ]
        self._handles.append(norm.register_forward_pre_hook(self._final_hook))

    def _aux_hook(self, i: int):
        def hook(module, args, kwargs):
            self.aux[i] = args[0] if args else kwargs["hidden_states"]

        return hook

    def _final_hook(self, module, args):
        self.final = args[0]

    def take(self, device: torch.device | str = "cpu") -> States:
        """(aux states concatenated on the last dim in aux_layer_ids order, final pre-norm state).

        With `device_map` the layers live on different GPUs: gather on `device` first."""
        aux = torch.cat([self.aux[i].to(device) for i in self.aux_layer_ids], dim=-1)
        final = self.final.to(device)
        self.aux, self.final = {}, None
        return aux, final

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def resolve_compute_dtype(configured: str, device: str) -> torch.dtype:
    # auto: float32 on CPU (bf16 matmuls take slow paths on CPUs without bf16 units),
    # bfloat16 on accelerators. Storage dtype is separate (hidden_states.dtype).
    if configured == "auto":
        return torch.float32 if device == "cpu" else torch.bfloat16
    return torch_dtype(configured)


def load_verifier(verifier_dir: str, device: str, compute_dtype: torch.dtype, trust_remote_code: bool = False):
    """The verifier for a forward pass. `device: auto` spreads its layers over every visible
    GPU with accelerate's device_map (for verifiers larger than one GPU)."""
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": compute_dtype, "trust_remote_code": trust_remote_code}
    if device == "auto":
        kwargs["device_map"] = "auto"
    try:
        model = AutoModelForCausalLM.from_pretrained(verifier_dir, attn_implementation="sdpa", **kwargs)
    except ValueError as exc:
        if "sdpa" not in str(exc).lower():
            raise
        log.warning("%s does not support sdpa attention; using its default", verifier_dir)
        model = AutoModelForCausalLM.from_pretrained(verifier_dir, **kwargs)
    if device != "auto":
        model = model.to(device)
    return model.eval()


@torch.inference_mode()
def extract(
    model,
    samples: list[dict[str, Any]],
    aux_layer_ids: list[int],
    batch_tokens: int,
    store_dtype: torch.dtype,
    pad_id: int = 0,
    progress: bool = True,
) -> list[States]:
    """Run the verifier over `samples`; return per-sample (aux, final) tensors in sample order."""
    num_layers = text_config(model.config.to_dict())["num_hidden_layers"]
    base, layers, norm = decoder_parts(model, num_layers)
    capture = StateCapture(layers, norm, aux_layer_ids)
    device = (
        base.get_input_embeddings().weight.device
        if hasattr(base, "get_input_embeddings")
        else next(model.parameters()).device
    )
    out: list[States | None] = [None] * len(samples)
    lengths = [len(s["input_ids"]) for s in samples]
    try:
        bar = tqdm(
            total=sum(lengths), desc="hidden states", unit="tok", unit_scale=True, mininterval=2.0, disable=not progress
        )
        for batch in token_budget_batches(lengths, batch_tokens):
            width = max(lengths[i] for i in batch)
            ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, i in enumerate(batch):
                ids[row, : lengths[i]] = torch.tensor(samples[i]["input_ids"])
                mask[row, : lengths[i]] = 1
            base(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)
            # One device-to-host copy per batch in the storage dtype, then unpadded views.
            aux, final = (t.to("cpu", store_dtype) for t in capture.take(device))
            for row, i in enumerate(batch):
                out[i] = (aux[row, : lengths[i]], final[row, : lengths[i]])
            bar.update(sum(lengths[i] for i in batch))
        bar.close()
    finally:
        capture.remove()
    return out
