"""One extraction job: the samples of its part (a stable hash of their ids: sample_keys.part_of)
that the sample store lacks, extracted by the configured backend and stored one file per
sample; then the part's manifest, which names every sample of the part by its key."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from eagleflow.common.atomic import write_json
from eagleflow.common.cache_keys import extraction_stack
from eagleflow.common.config import typed
from eagleflow.common.identity import verifier_fingerprint

# Importing a backend registers it. hf_server runs in its own process (the hf backend's
# server); imported here so that an edit to it restales the stored samples (common.fingerprint).
from eagleflow.hidden_states import hf, hf_server, vllm  # noqa: F401
from eagleflow.hidden_states.backend import ExtractionJob, HiddenStatesConfig, open_backend
from eagleflow.hidden_states.layers import resolve_aux_layer_ids, verifier_geometry
from eagleflow.hidden_states.sample_keys import sample_key, settings_key
from eagleflow.hidden_states.shard_file import ShardMeta, shard_content_digest, write_shard
from eagleflow.hidden_states.shards import check_disk_space, samples_for_part
from eagleflow.hidden_states.storage import extraction_dtype, num_stored_states, torch_dtype
from eagleflow.hidden_states.targets import TopkHead, head_device
from eagleflow.runtime.cache_plan import clear_mark, recompute_reason, recomputes_all
from eagleflow.runtime.server_args import result_args
from eagleflow.runtime.smk import stage
from eagleflow.runtime.spec import ServerConfig, ServerSpec
from eagleflow.runtime.state_store import STORE_DIR, BucketSampleStore, SampleStore, sample_store, states_location

log = logging.getLogger(__name__)


def main(smk) -> None:
    """The hidden_states rule's job (workflow/rules/hidden_states.smk): one part."""
    # The job claims its GPUs, as generate does: its own extraction server runs on them.
    with stage(smk):
        settings = typed(HiddenStatesConfig, smk.params.hidden_states, "hidden_states")
        run_part(
            smk.input.train,
            smk.input.eval,
            smk.input.verifier,
            int(smk.wildcards.states_part),
            smk.output[0],
            settings=settings,
            # The vllm backend's server; the hf backend has none, and no server setting restales
            # what transformers extracted.
            server=ServerConfig.from_section(smk.config["server"]) if settings.backend == "vllm" else None,
            threads=smk.threads,
            gpus=int(smk.resources.get("gpu", 0) or 0),
            trust_remote_code=smk.params.trust_remote_code,
            log_path=smk.log[0],
            code=smk.params.code,
            # Run-only (not a param): where the samples lie, beside the manifest or in a bucket.
            store_location=states_location(smk.config),
            # -R (or EAGLEFLOW_OUTPUT_CACHE=off): extract the part's samples again, stored or not.
            force=recomputes_all(recompute_reason([smk.output[0]])),
        )


# Settings that cannot change a sample's states: a change of these must not redo an extraction.
OPERATIONAL = {"mode", "num_shards", "store_every_tokens", "linger_s", "gpus", "vllm"}


def content_settings(
    settings: HiddenStatesConfig,
    server_args: list[list[str]] | None,
    layer_ids: list[int],
    trust_remote_code: bool,
    code: str,
    stack: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The settings a sample's states depend on (sample_keys.settings_key): `server_args`, the
    result flags of the vllm backend's server as launched (runtime.server_args; None for hf),
    and the `stack` that computes them (common.cache_keys.extraction_stack). Pure."""
    return {
        "stack": stack,
        "hidden_states": {k: v for k, v in dataclasses.asdict(settings).items() if k not in OPERATIONAL},
        "server": server_args,
        "aux_layer_ids": layer_ids,
        "trust_remote_code": trust_remote_code,
        "code": code,
    }


def content_name(sample: dict[str, Any]) -> str:
    """What a stored file calls its sample: its tokens and loss mask, hashed. Pure."""
    return sample_key("", sample["input_ids"], sample["loss_mask"])


def chunks(samples: list[dict[str, Any]], max_tokens: int) -> list[list[dict[str, Any]]]:
    """`samples` in order, cut into runs of at most `max_tokens` tokens (a longer sample alone). Pure."""
    out: list[list[dict[str, Any]]] = []
    tokens = 0
    for s in samples:
        n = len(s["input_ids"])
        if not out or tokens + n > max_tokens:
            out.append([])
            tokens = 0
        out[-1].append(s)
        tokens += n
    return out


def run_part(
    train: str,
    eval_: str,
    verifier_dir: str,
    part: int,
    out: str,
    *,
    settings: HiddenStatesConfig,
    server: ServerConfig | None,
    threads: int,
    gpus: int,
    trust_remote_code: bool,
    log_path: str,
    code: str = "",
    force: bool = False,
    store_location: str | None = None,
) -> dict[str, Any]:
    """Extract the samples of part `part` of `settings.num_shards` (the config's
    hidden_states.num_parts) that the store lacks (all of them with `force`) and write the
    part's manifest to `out`. The store lies beside `out`, or in the bucket `store_location`
    (runtime.state_store). Returns the manifest."""
    num_parts = settings.num_shards
    samples = samples_for_part(train, eval_, part, num_parts)
    geometry = verifier_geometry(verifier_dir)
    layer_ids = resolve_aux_layer_ids(settings.aux_layer_ids, geometry)
    server_args = result_args(ServerSpec.from_config(server, verifier_dir).command(0)) if server else None
    stack = extraction_stack(settings.backend, settings.device, server.env if server else None)
    made_by = settings_key(
        content_settings(settings, server_args, layer_ids, trust_remote_code, code, stack),
        verifier_fingerprint(verifier_dir),
    )
    store = sample_store(Path(out).parent / STORE_DIR, store_location)
    try:
        for s in samples:
            s["key"] = sample_key(made_by, s["input_ids"], s["loss_mask"])
        # One extraction per key: the same tokens under two ids are one sample of the store.
        todo = list({s["key"]: s for s in samples if force or not store.has(s["key"])}.values())
        tokens = sum(len(s["input_ids"]) for s in samples)
        extracted = sum(len(s["input_ids"]) for s in todo)
        log.info(
            "part %d/%d: %d samples; %d to extract (%d tokens), %d found stored%s",
            part,
            num_parts,
            len(samples),
            len(todo),
            extracted,
            len(samples) - len(todo),
            " (forced: every sample again)" if force else "",
        )
        started = time.monotonic()
        extract_s = 0.0
        # What this job is extracting, named beside the store until its manifest is written:
        # prune keeps those samples, so a killed job's rerun finds what it stored.
        pending = Path(out).with_suffix(".pending.json")
        if todo:
            write_json(pending, {"samples": [{"key": s["key"]} for s in todo]})
            extract_s = extract_into(
                store,
                todo,
                verifier_dir,
                layer_ids,
                geometry,
                settings,
                server,
                trust_remote_code,
                log_path,
                threads,
                gpus,
                force,
            )
        digests = store.digests([s["key"] for s in samples], shard_content_digest)
        manifest = {
            "part": part,
            "num_parts": num_parts,
            "settings_key": made_by,
            "aux_layer_ids": layer_ids,
            "num_layers": geometry.num_layers,
            "hidden_size": geometry.hidden_size,
            "dtype": settings.dtype,
            "target_topk": settings.target_topk,
            "backend": settings.backend,
            # A bucket's store is named; the default lies beside the manifest.
            **({"store": store.location} if store.location else {}),
            "samples": [
                {
                    "id": s["id"],
                    "split": s["split"],
                    "key": s["key"],
                    "num_tokens": len(s["input_ids"]),
                    "digest": digests[s["key"]],
                }
                for s in samples
            ],
            "stats": {
                "samples": len(samples),
                "tokens": tokens,
                "extracted_samples": len(todo),
                "extracted_tokens": extracted,
                "stored_samples": len(samples) - len(todo),
                "stored_tokens": tokens - extracted,
                "verifier_loads": 1 if todo else 0,
                "wall_s": round(time.monotonic() - started, 3),
                # From the server's first answer to the last sample stored: the extraction's rate
                # (plan.hours), without the start a planned load already counts.
                "extract_s": round(extract_s, 3),
                **(
                    {"uploaded_samples": store.uploaded, "uploaded_bytes": store.uploaded_bytes}
                    if store.location
                    else {}
                ),
            },
        }
        write_json(out, manifest)
        pending.unlink(missing_ok=True)
        clear_mark([out])
        return manifest
    finally:
        store.close()  # a bucket's staging directory


def extract_into(
    store: SampleStore | BucketSampleStore,
    todo: list[dict[str, Any]],
    verifier_dir: str,
    layer_ids: list[int],
    geometry: Any,
    settings: HiddenStatesConfig,
    server: ServerConfig | None,
    trust_remote_code: bool,
    log_path: str,
    threads: int,
    gpus: int,
    force: bool = False,
) -> float:
    """Run the backend over `todo` a chunk at a time and store each sample as its chunk ends:
    a job killed mid-part keeps every finished chunk. Returns the seconds from the server's
    readiness to the last sample stored."""
    topk = settings.target_topk
    total = sum(len(s["input_ids"]) for s in todo)
    # A bucket's samples leave the local disk as each is uploaded: one chunk at most is staged.
    staged = todo if store.keeps_locally else max(chunks(todo, settings.store_every_tokens), key=len)
    check_disk_space(
        store.root,
        sum(len(s["input_ids"]) for s in staged),
        len(staged),
        num_stored_states(len(layer_ids), topk),
        geometry.hidden_size,
        settings.dtype,
        topk,
    )
    # The backends hand over states in the extraction dtype; fp8 is quantized on write.
    store_dtype = torch_dtype(extraction_dtype(settings.dtype))
    job = ExtractionJob(
        verifier_dir, layer_ids, geometry, store_dtype, settings, server, trust_remote_code, log_path, threads, gpus
    )
    head = TopkHead(verifier_dir, topk, head_device(settings.device)) if topk else None
    with (
        open_backend(settings.backend, job) as backend,
        tqdm(total=total, desc="store", unit="tok", mininterval=2.0) as bar,
    ):
        ready = time.monotonic()
        # A chunk's states are stored as it ends: what a killed job loses at most.
        for chunk in chunks(todo, settings.store_every_tokens):
            states = backend.extract(chunk)
            for s, st in zip(chunk, states, strict=True):
                if not force and store.has(s["key"]):
                    continue  # another job stored it meanwhile: the first writer's bytes stand
                # The compact target: the verifier's top-k logits replace the final state.
                targets = [head(st[1])] if head is not None else None
                # The file names its sample by content alone (not the key, which names the
                # software that made it): the same states under another key digest the same.
                name = content_name(s)
                meta = ShardMeta([name], layer_ids, geometry.num_layers, geometry.hidden_size, settings.backend)
                # A forced job replaces the file (the rename replaces a read-only file too).
                write_shard(
                    store.path(s["key"]), [{**s, "id": name, "split": "train"}], [st], meta, settings.dtype, targets
                )
                store.seal(s["key"], shard_content_digest(store.path(s["key"])))
            bar.update(sum(len(s["input_ids"]) for s in chunk))
        return time.monotonic() - ready
