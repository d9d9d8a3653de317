"""hidden_states: the verifier's aux-layer and final-layer states for every training token.

Layer convention (vLLM and speculators): an aux layer id `i` is the *input* of decoder
layer i (the residual stream after layers 0..i-1), by default i in (2, L//2, L-3); the
final state is the last layer's output *before* the final norm, which vLLM names layer id
L. The trainer recomputes the verifier's logits as lm_head(norm(final)).

Two backends write the same shard, chosen by `hidden_states.backend`:

- `hf`: a transformers forward (CPU, one GPU, or several with `device: auto`), batched by
  token budget. Hooks record exactly the tensors above during the base model's forward,
  so no per-layer tuple is kept and no logits are computed.
- `vllm`: vLLM's `extract_hidden_states` speculative method with its hidden-states KV
  connector, for verifiers only vLLM can serve (INT4 MoE, tensor parallel 8).

Each shard is one Snakemake job and one safetensors file, written atomically (a killed job
leaves no shard). Tokens are stored unpadded: bytes per token = (len(aux) + 1) x hidden x
dtype size.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import pyarrow.parquet as pq
import torch
from tqdm import tqdm

from workflow_scripts.common.atomic import write_json, write_safetensors
from workflow_scripts.common.client import ChatClient, RequestFailed
from workflow_scripts.common.server import ServerSpec, serve
from workflow_scripts.common.verifier_config import read_text_config, text_config

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
CONVENTION = (
    "aux i = input of decoder layer i (vLLM/speculators); "
    "final = last layer output before the final norm (vLLM layer id L)"
)

# (aux states [tokens, n_aux * hidden], final pre-norm state [tokens, hidden]) per sample
States = tuple[torch.Tensor, torch.Tensor]


# ---------------------------------------------------------------------------------------
# Verifier geometry and layer ids (pure)


@dataclass(frozen=True)
class VerifierGeometry:
    num_layers: int
    hidden_size: int


def verifier_geometry(verifier_dir: str) -> VerifierGeometry:
    """Layers and hidden size from config.json alone: no model code, no weights (the disk
    check runs before a 1T-parameter verifier is loaded)."""
    config = read_text_config(verifier_dir)
    try:
        return VerifierGeometry(int(config["num_hidden_layers"]), int(config["hidden_size"]))
    except (KeyError, ValueError) as exc:
        raise ValueError(
            f"{Path(verifier_dir) / 'config.json'}: cannot read num_hidden_layers and hidden_size ({exc})"
        ) from exc


def default_aux_layer_ids(num_layers: int) -> list[int]:
    return [2, num_layers // 2, num_layers - 3]


def resolve_aux_layer_ids(configured: list[int] | None, num_layers: int) -> list[int]:
    ids = list(configured) if configured else default_aux_layer_ids(num_layers)
    # Ascending because vLLM emits aux states in layer order whatever order they are listed in.
    if ids != sorted(set(ids)) or min(ids) < 0 or max(ids) >= num_layers:
        raise ValueError(
            f"hidden_states.aux_layer_ids {ids} must be strictly ascending layer indices in 0..{num_layers - 1}"
        )
    return ids


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


def shard_bytes(num_tokens: int, num_states: int, hidden_size: int, dtype: torch.dtype) -> int:
    return num_tokens * num_states * hidden_size * torch.empty((), dtype=dtype).element_size()


def check_disk_space(out_dir: Path, num_tokens: int, num_states: int, hidden_size: int, dtype: torch.dtype) -> int:
    """Log what the shard will take and refuse to start when the target disk lacks room."""
    need = shard_bytes(num_tokens, num_states, hidden_size, dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out_dir).free
    log.info(
        "will write %d bytes (%.2f GB: %d tokens x %d states x %d hidden x %s); %d bytes free on %s",
        need,
        need / 1e9,
        num_tokens,
        num_states,
        hidden_size,
        dtype,
        free,
        out_dir,
    )
    if need > free:
        raise OSError(
            f"{out_dir}: the hidden states need {need} bytes ({need / 1e9:.2f} GB) but only {free} bytes "
            f"({free / 1e9:.2f} GB) are free: free space, raise hidden_states.num_shards "
            "(shards are written one at a time per job) or store in a smaller hidden_states.dtype"
        )
    return need


# ---------------------------------------------------------------------------------------
# Backends


class Backend(Protocol):
    """Runs the verifier over samples and returns each sample's unpadded states, in order."""

    def extract(self, samples: list[dict[str, Any]]) -> list[States]: ...


@dataclass(frozen=True)
class ExtractionJob:
    """What every backend needs, whatever runs the verifier."""

    verifier_dir: str
    aux_layer_ids: list[int]
    geometry: VerifierGeometry
    store_dtype: torch.dtype
    settings: dict[str, Any]  # the hidden_states config section
    server: dict[str, Any] = field(default_factory=dict)  # the server config section
    trust_remote_code: bool = False
    log_path: str | None = None
    threads: int = 1


BackendFactory = Callable[[ExtractionJob], contextlib.AbstractContextManager[Backend]]
BACKENDS: dict[str, BackendFactory] = {}


def register_backend(name: str) -> Callable[[BackendFactory], BackendFactory]:
    def add(factory: BackendFactory) -> BackendFactory:
        BACKENDS[name] = factory
        return factory

    return add


def open_backend(name: str, job: ExtractionJob) -> contextlib.AbstractContextManager[Backend]:
    try:
        factory = BACKENDS[name]
    except KeyError:
        raise ValueError(f"hidden_states.backend is {name!r}; known backends: {sorted(BACKENDS)}") from None
    return factory(job)


# --- hf --------------------------------------------------------------------------------


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
    return DTYPES[configured]


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
        bar = tqdm(total=sum(lengths), desc="hidden states", unit="tok", unit_scale=True, mininterval=2.0)
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


@dataclass
class HfBackend:
    model: Any
    aux_layer_ids: list[int]
    batch_tokens: int
    store_dtype: torch.dtype
    pad_id: int

    def extract(self, samples: list[dict[str, Any]]) -> list[States]:
        return extract(self.model, samples, self.aux_layer_ids, self.batch_tokens, self.store_dtype, self.pad_id)


@register_backend("hf")
@contextlib.contextmanager
def hf_backend(job: ExtractionJob) -> Iterator[HfBackend]:
    torch.set_num_threads(job.threads)
    device = job.settings["device"]
    compute_dtype = resolve_compute_dtype(job.settings.get("compute_dtype", "auto"), device)
    model = load_verifier(job.verifier_dir, device, compute_dtype, job.trust_remote_code)
    pad_id = getattr(model.config, "pad_token_id", None) or 0
    yield HfBackend(model, job.aux_layer_ids, job.settings["batch_tokens"], job.store_dtype, pad_id)


# --- vllm ------------------------------------------------------------------------------
#
# vLLM (checked against 0.32.0) extracts hidden states as a speculative "method": the
# ExtractHiddenStatesModel drafter writes the verifier's aux states for every scheduled
# token into a cache-only KV layer, and ExampleHiddenStatesConnector copies a finished
# request's slots to `<shared_storage_path>/<request id>.safetensors` holding
# `hidden_states` [prompt tokens, len(layer ids), hidden] (layer order, model dtype) and
# `token_ids` [prompt tokens]. It holds LOCK_EX on `<file>.lock` until the write is done;
# the completion response names the file in `kv_transfer_params.hidden_states_path`.
# Layer id L (num_layers) is the last layer's output before the final norm.

CONNECTOR = "ExampleHiddenStatesConnector"


def vllm_layer_ids(aux_layer_ids: list[int], num_layers: int) -> list[int]:
    return [*aux_layer_ids, num_layers]


def extraction_server_args(
    aux_layer_ids: list[int], num_layers: int, storage_dir: str
) -> tuple[dict[str, Any], list[str]]:
    """(speculative config, extra CLI args) that make vLLM write hidden states. Pure."""
    speculative_config = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,  # the only value the method accepts
        "draft_model_config": {
            "hf_config": {"eagle_aux_hidden_state_layer_ids": vllm_layer_ids(aux_layer_ids, num_layers)}
        },
    }
    kv_transfer_config = {
        "kv_connector": CONNECTOR,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": storage_dir},
    }
    # Prefix caching would let a request reuse another's cached blocks; every token's
    # states are computed and written per request instead.
    return speculative_config, ["--kv-transfer-config", json.dumps(kv_transfer_config), "--no-enable-prefix-caching"]


def completion_request(input_ids: list[int], served_model_name: str) -> dict[str, Any]:
    """A completion over exactly the sample's tokens (no chat template, no BOS added): the
    prefill computes every token's states; one generated token ends the request."""
    return {
        "model": served_model_name,
        "prompt": list(input_ids),
        "max_tokens": 1,
        "temperature": 0.0,
        "kv_transfer_params": {"include_output_tokens": False},
    }


class HiddenStatesFileError(RuntimeError):
    """The connector's output for a sample is missing, late or does not match the sample."""


def wait_for_unlock(lock_path: Path, timeout_s: float) -> None:
    """Block until the connector released its exclusive lock (the write is complete)."""
    # The connector creates the lock (holding LOCK_EX) before the reply names the file;
    # no lock file means it runs with use_synchronization_lock off.
    deadline = time.monotonic() + timeout_s
    try:
        fh = open(lock_path)  # noqa: SIM115 (closed by the `with` below; a missing file is an answer)
    except FileNotFoundError:
        return
    with fh:
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_SH | fcntl.LOCK_NB)
                fcntl.flock(fh, fcntl.LOCK_UN)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise HiddenStatesFileError(f"{lock_path}: vLLM still writing after {timeout_s:.0f} s") from None
                time.sleep(0.05)


def split_states(stacked: torch.Tensor, num_aux: int) -> States:
    """[tokens, num_aux + 1, hidden] in layer order -> (aux [tokens, num_aux * hidden], final). Pure."""
    tokens, states, hidden = stacked.shape
    if states != num_aux + 1:
        raise HiddenStatesFileError(f"expected {num_aux + 1} states per token, got {states}")
    return stacked[:, :num_aux].reshape(tokens, num_aux * hidden), stacked[:, num_aux]


def read_connector_output(
    path: str, sample: dict[str, Any], num_aux: int, hidden_size: int, store_dtype: torch.dtype, timeout_s: float
) -> States:
    """Read, check and delete one request's hidden-states file."""
    from safetensors.torch import load_file

    file = Path(path)
    lock = Path(f"{path}.lock")
    wait_for_unlock(lock, timeout_s)
    if not file.exists():
        raise HiddenStatesFileError(
            f"sample {sample['id']}: vLLM named {file} but it does not "
            "exist (is shared_storage_path on a filesystem this job sees?)"
        )
    data = load_file(str(file))
    token_ids = data["token_ids"].tolist()
    if token_ids != list(sample["input_ids"]):
        raise HiddenStatesFileError(
            f"sample {sample['id']}: {file} holds {len(token_ids)} tokens that "
            f"differ from the sample's {len(sample['input_ids'])} input_ids"
        )
    stacked = data["hidden_states"]
    if stacked.dim() != 3 or stacked.shape[0] != len(token_ids) or stacked.shape[2] != hidden_size:
        raise HiddenStatesFileError(
            f"sample {sample['id']}: {file} has hidden_states {tuple(stacked.shape)}, "
            f"expected ({len(token_ids)}, {num_aux + 1}, {hidden_size})"
        )
    aux, final = split_states(stacked.to(store_dtype), num_aux)
    file.unlink()
    lock.unlink(missing_ok=True)
    return aux, final


@dataclass
class VllmBackend:
    base_url: str
    served_model_name: str
    num_aux: int
    hidden_size: int
    store_dtype: torch.dtype
    concurrency: int
    request_timeout_s: float
    api_key_env: str | None = None

    async def _one(self, client: ChatClient, sample: dict[str, Any]) -> States:
        try:
            body = await client.completion(completion_request(sample["input_ids"], self.served_model_name))
        except RequestFailed as exc:
            raise HiddenStatesFileError(f"sample {sample['id']}: /v1/completions failed: {exc}") from exc
        path = (body.get("kv_transfer_params") or {}).get("hidden_states_path")
        if not path:
            raise HiddenStatesFileError(
                f"sample {sample['id']}: the reply of {self.base_url} has no kv_transfer_params.hidden_states_path: "
                f"the server does not run the extract_hidden_states method with {CONNECTOR}"
            )
        # Waiting on the connector's lock and reading the file block: a worker thread does it
        # while the other requests keep flowing.
        return await asyncio.to_thread(
            read_connector_output,
            path,
            sample,
            self.num_aux,
            self.hidden_size,
            self.store_dtype,
            self.request_timeout_s,
        )

    def extract(self, samples: list[dict[str, Any]]) -> list[States]:
        return asyncio.run(self._extract(samples))

    async def _extract(self, samples: list[dict[str, Any]]) -> list[States]:
        bar = tqdm(
            total=sum(len(s["input_ids"]) for s in samples),
            desc="hidden states (vLLM)",
            unit="tok",
            unit_scale=True,
            mininterval=2.0,
        )
        slots = asyncio.Semaphore(self.concurrency)
        client = ChatClient(
            self.base_url,
            concurrency=self.concurrency,
            request_timeout_s=self.request_timeout_s,
            api_key_env=self.api_key_env,
        )

        async def one(sample: dict[str, Any]) -> States:
            async with slots:
                states = await self._one(client, sample)
            bar.update(len(sample["input_ids"]))
            return states

        async with client:
            tasks = [asyncio.create_task(one(s)) for s in samples]
            try:
                return list(await asyncio.gather(*tasks))
            except BaseException:
                # Fail now: cancel what has not finished, and let it unwind before the client closes.
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
            finally:
                bar.close()


@register_backend("vllm")
@contextlib.contextmanager
def vllm_backend(job: ExtractionJob) -> Iterator[VllmBackend]:
    """Launch vLLM with the extraction method (through the one server launcher), or use an
    already running one (`hidden_states.vllm.endpoint`, started with the same layer ids and
    a storage path this job can read)."""
    opts = job.settings.get("vllm") or {}
    endpoint = opts.get("endpoint")
    storage_parent = opts.get("storage_dir")
    if storage_parent:
        Path(storage_parent).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="eagleflow-hs-", dir=storage_parent) as storage_dir:
        speculative_config, extra = extraction_server_args(job.aux_layer_ids, job.geometry.num_layers, storage_dir)
        spec = ServerSpec.from_config(job.server, job.verifier_dir)
        trust = (
            ["--trust-remote-code"] if job.trust_remote_code and "--trust-remote-code" not in spec.extra_args else []
        )
        spec = replace(spec, speculative_config=speculative_config, extra_args=(*spec.extra_args, *extra, *trust))
        # The server's log goes next to the rule's log.
        log_path = Path(job.log_path).with_suffix(".vllm.log") if job.log_path else Path(storage_dir) / "vllm.log"
        with serve(spec, log_path, endpoint) as url:
            yield VllmBackend(
                base_url=url if isinstance(url, str) else url[0],
                served_model_name=spec.served_model_name,
                num_aux=len(job.aux_layer_ids),
                hidden_size=job.geometry.hidden_size,
                store_dtype=job.store_dtype,
                concurrency=int(opts.get("concurrency", 32)),
                request_timeout_s=float(opts.get("request_timeout_s", 600)),
                api_key_env=job.server.get("api_key_env"),
            )


# ---------------------------------------------------------------------------------------
# Shards and index


def samples_for_shard(train: str, eval_: str, shard: int, num_shards: int) -> list[dict[str, Any]]:
    rows = []
    for split, path in (("train", train), ("eval", eval_)):
        for r in pq.read_table(path, columns=["id", "input_ids", "loss_mask"]).to_pylist():
            rows.append({**r, "split": split})
    rows.sort(key=lambda r: r["id"])
    return rows[shard::num_shards]


def shard_tensors(samples: list[dict[str, Any]], states: list[States]) -> dict[str, torch.Tensor]:
    """The shard's tensors: states and tokens of all samples back to back, unpadded. Pure."""
    offsets = [0]
    for s, (aux, final) in zip(samples, states, strict=True):
        n = len(s["input_ids"])
        if aux.shape[0] != n or final.shape[0] != n:
            raise ValueError(f"sample {s['id']}: {n} tokens but states for {aux.shape[0]} / {final.shape[0]}")
        offsets.append(offsets[-1] + n)
    return {
        "hidden_states": torch.cat([a for a, _ in states]),
        "verifier_last_hidden_states": torch.cat([f for _, f in states]),
        "input_ids": torch.tensor([t for s in samples for t in s["input_ids"]], dtype=torch.int32),
        "loss_mask": torch.tensor([t for s in samples for t in s["loss_mask"]], dtype=torch.int8),
        "offsets": torch.tensor(offsets, dtype=torch.int64),
        "is_eval": torch.tensor([s["split"] == "eval" for s in samples], dtype=torch.bool),
    }


def run_shard(
    train: str,
    eval_: str,
    verifier_dir: str,
    shard: int,
    num_shards: int,
    out: str,
    *,
    settings: dict[str, Any],
    server: dict[str, Any] | None = None,
    threads: int = 1,
    trust_remote_code: bool = False,
    log_path: str | None = None,
) -> None:
    """Extract one shard with the configured backend. `settings` is the hidden_states config section."""
    samples = samples_for_shard(train, eval_, shard, num_shards)
    if not samples:
        raise ValueError(f"shard {shard} of {num_shards} has no samples: lower hidden_states.num_shards")
    geometry = verifier_geometry(verifier_dir)
    layer_ids = resolve_aux_layer_ids(settings.get("aux_layer_ids"), geometry.num_layers)
    store_dtype = DTYPES[settings["dtype"]]
    num_tokens = sum(len(s["input_ids"]) for s in samples)
    check_disk_space(Path(out).parent, num_tokens, len(layer_ids) + 1, geometry.hidden_size, store_dtype)
    job = ExtractionJob(
        verifier_dir, layer_ids, geometry, store_dtype, settings, server or {}, trust_remote_code, log_path, threads
    )
    backend_name = settings["backend"]
    started = time.monotonic()
    with open_backend(backend_name, job) as backend:
        states = backend.extract(samples)
    metadata = {
        "sample_ids": json.dumps([s["id"] for s in samples]),
        "aux_layer_ids": json.dumps(layer_ids),
        "final_layer_id": str(geometry.num_layers),
        "num_layers": str(geometry.num_layers),
        "hidden_size": str(geometry.hidden_size),
        "backend": backend_name,
        "convention": CONVENTION,
    }
    write_safetensors(out, shard_tensors(samples, states), metadata)
    log.info(
        "shard %d/%d (%s): %d samples, %d tokens in %.1f s -> %s",
        shard,
        num_shards,
        backend_name,
        len(samples),
        num_tokens,
        time.monotonic() - started,
        out,
    )


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
            "backend": meta.get("backend", "hf"),
        }


def write_index(shards: list[str], verifier_dir: str, out: str) -> None:
    headers = [read_shard_header(s) for s in shards]
    first = headers[0]
    for h in headers[1:]:
        for key in ("aux_layer_ids", "num_layers", "hidden_size", "dtype"):
            if h[key] != first[key]:
                raise ValueError(
                    f"shard {h['path']} has {key}={h[key]}, shard "
                    f"{first['path']} has {first[key]}: rerun the stale shard"
                )
    write_json(
        out,
        {
            "verifier": verifier_dir,
            "aux_layer_ids": first["aux_layer_ids"],
            "final_layer_id": first["num_layers"],
            "vllm_layer_ids": vllm_layer_ids(first["aux_layer_ids"], first["num_layers"]),
            "num_layers": first["num_layers"],
            "hidden_size": first["hidden_size"],
            "dtype": first["dtype"],
            "backends": sorted({h["backend"] for h in headers}),
            "convention": CONVENTION,
            "num_samples": sum(h["num_samples"] for h in headers),
            "num_tokens": sum(h["num_tokens"] for h in headers),
            "shards": headers,
        },
    )
