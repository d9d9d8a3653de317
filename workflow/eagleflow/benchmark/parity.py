"""The parity rule: replay the benchmark's served streams with the draft as eagleflow trained
it, set the replay's acceptance next to vLLM's, and check what makes them differ.

Two gaps, two kinds of cause:
- vLLM below the replay on the same streams: serving does not run the draft that was trained
  (aux layer ids in the exported config, the d2t map, the draft's config or weights as vLLM
  reads them).
- the replay (every anchor, as training estimates) below the training-time estimate: the
  draft was trained on something other than what it is served (the targets, e.g. the
  verifier's final norm; the prompts' format; the workload's lengths and style).
Direct checks name the usual causes: the exported aux layer ids and d2t against the ones
training used, and the served prompt tokens against the chat template as synth applied it.

The gap checks use the eval split's streams, which vLLM's headline counters cover. Every
set's greedy streams are replayed: their acceptance next to vLLM's per set, and acceptance by
the context length each draft was proposed at (common.acceptance.ContextBuckets), beside the
longest context the draft was trained on.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from eagleflow.benchmark.cells import EVAL, cell_key
from eagleflow.benchmark.parity_checks import (
    ParityConfig,
    ParityError,
    check_aux_layer_ids,
    check_block_causality,
    check_d2t,
    check_gaps,
    check_prompt_format,
    check_targets,
    check_training_vs_served,
)
from eagleflow.common.acceptance import AcceptanceCounts, ContextBuckets, context_edges, every_anchor
from eagleflow.common.atomic import read_jsonl, write_json
from eagleflow.common.cache_keys import TRAIN_PACKAGES, extraction_stack, software
from eagleflow.common.config import typed
from eagleflow.common.exported_eval import exported_eval

# Importing a backend registers it (as in the hidden_states stage, whose backends replay uses).
from eagleflow.hidden_states import hf, vllm  # noqa: F401
from eagleflow.hidden_states.backend import ExtractionJob, HiddenStatesConfig, open_backend
from eagleflow.hidden_states.layers import resolve_aux_layer_ids, verifier_geometry
from eagleflow.hidden_states.storage import as_read_back, extraction_dtype, torch_dtype
from eagleflow.runtime.output_cache import reuse_or_make
from eagleflow.runtime.smk import stage
from eagleflow.runtime.spec import ServerConfig
from eagleflow.train.data import Sample, shift

log = logging.getLogger(__name__)


def main(smk) -> None:
    """The parity rule's job (workflow/rules/benchmark.smk)."""
    with stage(smk, claim_gpus=False) as log:
        extraction = extraction_job(
            smk.input.verifier,
            smk.params.hidden_states,
            # The server section for the vllm backend (its result flags are the rule's param).
            smk.config["server"] if smk.params.hidden_states["backend"] == "vllm" else None,
            smk.params.trust_remote_code,
            log_path=smk.log[0],
            threads=smk.threads,
            gpus=int(smk.resources.get("gpu", 0) or 0),
        )
        reuse_or_make(
            smk,
            lambda: run_parity(
                extraction,
                draft_dir=smk.input.draft,
                vocab_map=smk.input.vocab_map,
                streams_path=smk.input.streams,
                benchmark_report=smk.input.report,
                metrics_path=smk.input.metrics,
                prompts_path=smk.input.prompts,
                train_path=smk.input.train,
                max_model_len=smk.params.max_model_len,
                max_seq_len=smk.params.max_seq_len,
                out=smk.output.report,
                chat_template_kwargs=smk.params.chat_template_kwargs,
                greedy_data=smk.params.synth_temperature == 0,
                cfg=typed(ParityConfig, smk.params.parity, "parity"),
            ),
            log,
            # The replay's states come from the extraction backend; the draft runs on torch.
            {
                **extraction_stack(
                    extraction.settings.backend,
                    extraction.settings.device,
                    extraction.server.env if extraction.server else None,
                ),
                "draft_software": software(TRAIN_PACKAGES),
            },
        )


def extraction_job(
    verifier_dir: str,
    hidden_states: dict[str, Any],
    server: dict[str, Any] | None,
    trust_remote_code: bool,
    *,
    log_path: str,
    threads: int,
    gpus: int,
) -> ExtractionJob:
    """What the hidden-state stage's backend needs to compute the replay's states, from the
    `hidden_states` section (and the `server` section for the vllm backend)."""
    settings = typed(HiddenStatesConfig, hidden_states, "hidden_states")
    geometry = verifier_geometry(verifier_dir)
    return ExtractionJob(
        verifier_dir,
        resolve_aux_layer_ids(settings.aux_layer_ids, geometry),
        geometry,
        torch_dtype(extraction_dtype(settings.dtype)),
        settings,
        ServerConfig.from_section(server) if server else None,
        trust_remote_code,
        log_path,
        threads,
        gpus,
        phase="parity",
    )


def expected_prompt_ids(verifier_dir: str, prompts_path: str, ids: list[str], chat_template_kwargs, trust: bool):
    """Prompt id -> the tokens synth's chat template gives for the benchmark's messages."""
    from transformers import AutoTokenizer

    from eagleflow.benchmark.workload import first_turn_messages
    from eagleflow.synth.assemble import rebuild_prompt_ids

    tokenizer = AutoTokenizer.from_pretrained(verifier_dir, trust_remote_code=trust)
    prompts = {p["id"]: p for p in read_jsonl(prompts_path)}
    return {i: rebuild_prompt_ids(tokenizer, first_turn_messages(prompts[i]), chat_template_kwargs) for i in ids}


def stream_samples(extraction: ExtractionJob, streams: list[dict], shifted: bool = True) -> list[Sample]:
    """The served streams as training reads its samples: the verifier's states computed by the
    hidden-state stage's backend, rounded through the storage dtype, shifted (EAGLE-3) or as
    they are, every position (a block drafter: train.proposals.block_proposals). The backend's
    server is the phase's shared one: the parity jobs of every variant run back to back (the
    benchmark jobs go first, workflow/rules/benchmark.smk) and use one load (logs/parity.server.log);
    compare stops it."""
    with open_backend(extraction.settings.backend, extraction) as backend:
        states = backend.extract([{"id": s["id"], "input_ids": stream_tokens(s)} for s in streams])
    dtype = extraction.settings.dtype
    n_aux = len(extraction.aux_layer_ids)
    out = []
    for s, (aux, final) in zip(streams, states, strict=True):
        tokens = stream_tokens(s)
        mask = torch.tensor([0] * len(s["prompt_token_ids"]) + [1] * len(s["token_ids"]), dtype=torch.bool)
        align = shift if shifted else Sample
        out.append(align(torch.tensor(tokens), as_read_back(aux, n_aux, dtype), as_read_back(final, 1, dtype), mask))
    return out


def stream_tokens(stream: dict) -> list[int]:
    return list(stream["prompt_token_ids"]) + list(stream["token_ids"])


@dataclass
class SetReplay:
    """A set's streams replayed: the anchors vLLM visits by context length (their sum is the
    walk's counts), and every anchor."""

    context: ContextBuckets
    every: AcceptanceCounts
    streams: int = 0

    @property
    def visited(self) -> AcceptanceCounts:
        return self.context.total()


def replay_streams(
    propose: Callable[[Any, Sample, int], list[list[int]]],
    draft,
    samples: list[Sample],
    streams: list[dict],
    k: int,
    edges: list[int],
) -> dict[str, SetReplay]:
    """Each set's replay of the draft over its served streams, by set name; `propose`: the
    method's proposals at every anchor (train.proposals)."""
    out: dict[str, SetReplay] = {}
    for stream, sample in tqdm(list(zip(streams, samples, strict=True)), desc="replay", unit="stream", mininterval=2.0):
        proposals = propose(draft, sample, k)
        tokens, prompt_len = stream_tokens(stream), len(stream["prompt_token_ids"])
        name = stream.get("set", EVAL)
        r = out.setdefault(name, SetReplay(ContextBuckets(k, edges), AcceptanceCounts(k)))
        r.every.add(every_anchor(tokens, prompt_len, proposals))
        r.context.add_walk(tokens, prompt_len, proposals)
        r.streams += 1
    return out


def context_report(replays: dict[str, SetReplay], edges: list[int], trained: dict[str, int | None]) -> dict[str, Any]:
    """Acceptance by context length, per set and over all, with the lengths training saw. Pure."""
    every_set = ContextBuckets(next(iter(replays.values())).context.k, edges)
    for r in replays.values():
        every_set.add(r.context)
    return {
        "edges": edges,
        "sets": {name: r.context.rows() for name, r in replays.items()},
        "all": every_set.rows(),
        "trained": trained,
    }


def set_replays(replays: dict[str, SetReplay], benchmark: dict[str, Any]) -> dict[str, Any]:
    """Per set: vLLM's acceptance at temperature 0 beside the replay's. Pure."""
    out = {}
    for name, r in replays.items():
        served = benchmark["cells"][cell_key(name, 0.0)]["speculative"]["mean_acceptance_length"]
        replay = r.visited.summary()["mean_acceptance_length"]
        out[name] = {
            "streams": r.streams,
            "vllm": served,
            "replay": replay,
            "replay_every_anchor": r.every.summary()["mean_acceptance_length"],
            "gap": served - replay,
        }
    return out


def training_lengths(train_path: str, max_seq_len: int | None) -> dict[str, int | None]:
    """The longest context the draft was trained on: the config's cut and the longest sample."""
    import pyarrow.parquet as pq

    lengths = pq.read_table(train_path, columns=["length"]).column("length").to_pylist()
    return {"max_seq_len": max_seq_len, "longest_sample": max(lengths, default=None)}


def run_parity(
    extraction: ExtractionJob,
    *,
    draft_dir: str,
    vocab_map: str,
    streams_path: str,
    benchmark_report: str,
    metrics_path: str,
    prompts_path: str,
    train_path: str,
    max_model_len: int,
    max_seq_len: int | None,
    out: str,
    chat_template_kwargs: dict[str, Any],
    greedy_data: bool,
    cfg: ParityConfig,
) -> dict[str, Any]:
    """Replay, compare, check; write the parity report. Raises ParityError after writing it
    (to the rule log's directory, since a failed job's outputs are removed) when a check
    fails and parity.on_gap is `fail`."""
    from eagleflow.train.draft import draft_aux_layer_ids, load_draft
    from eagleflow.train.methods import draft_method

    report = json.loads(Path(benchmark_report).read_text())
    streams = read_jsonl(streams_path)
    k = int(report["num_speculative_tokens"])
    with safe_open(vocab_map, framework="pt") as f:
        d2t = f.get_tensor("d2t").long()
    verifier_dir = extraction.verifier_dir
    # sdpa: a dense mask runs on every device; one stream at a time is small.
    draft = load_draft(draft_dir, verifier_dir, attn_impl="sdpa").eval()
    with safe_open(str(Path(draft_dir) / "model.safetensors"), framework="pt") as f:
        exported_d2t = f.get_tensor("d2t") if "d2t" in f.keys() else None  # noqa: SIM118 (safe_open is no dict)
    # Streams too short to hold a draft step carry nothing to replay.
    streams = [s for s in streams if len(s["token_ids"]) >= 2]
    if exported_d2t is not None and exported_d2t.shape == d2t.shape:
        # The replay maps the draft's tokens with the vocab stage's map, as training did.
        draft.d2t.copy_(d2t.to(draft.d2t.dtype))
    eval_streams = [s for s in streams if s.get("set", EVAL) == EVAL]
    served = report["speculative"]
    trained = exported_eval(read_jsonl(metrics_path))
    estimate = trained.get("estimated_acceptance_length")
    expected = expected_prompt_ids(
        verifier_dir, prompts_path, [s["id"] for s in eval_streams], chat_template_kwargs, extraction.trust_remote_code
    )
    findings = [
        *check_aux_layer_ids(draft_aux_layer_ids(draft.config), extraction.aux_layer_ids),
        *check_d2t(exported_d2t, d2t),
        *check_prompt_format(eval_streams, expected),
        *check_targets(trained.get("target_agreement"), greedy_data, cfg),
        *check_block_causality(json.loads((Path(draft_dir) / "config.json").read_text())),
    ]
    result = {
        "draft": draft_dir,
        "method": report["method"],
        "streams": {"path": streams_path, "count": len(eval_streams), "all_sets": len(streams)},
        "num_speculative_tokens": k,
        "vllm": {key: served[key] for key in ("mean_acceptance_length", "per_position_acceptance", "num_drafts")},
        "training_estimate": estimate,
        "training_walk_estimate": trained.get("walk_acceptance_length"),
        "training_target_agreement": trained.get("target_agreement"),
        "tolerance": cfg.tolerance,
        "training_tolerance": cfg.training_tolerance,
    }
    method = draft_method(result["method"])
    if method.propose:
        edges = context_edges(max_model_len)
        samples = stream_samples(extraction, streams, method.shifted)
        replays = replay_streams(method.propose, draft, samples, streams, k, edges)
        if EVAL not in replays:
            raise ValueError(f"{streams_path}: no stream of the eval split with a draft step to replay")
        replay, replay_every = replays[EVAL].visited.summary(), replays[EVAL].every.summary()
        findings += check_gaps(
            served["mean_acceptance_length"],
            replay["mean_acceptance_length"],
            replay_every["mean_acceptance_length"],
            estimate,
            cfg,
        )
        result |= {
            "replay": replay,
            "replay_every_anchor": replay_every,
            "gap": served["mean_acceptance_length"] - replay["mean_acceptance_length"],
            "sets": set_replays(replays, report),
            "context": context_report(replays, edges, training_lengths(train_path, max_seq_len)),
        }
    else:
        # No replay of this method's drafting yet: the direct checks, and training's estimate
        # against what vLLM measured (the gap a replay would split in two).
        findings += check_training_vs_served(estimate, served["mean_acceptance_length"], cfg)
        result |= {
            "replay": None,
            "replay_unavailable": f"parity replays EAGLE-3's chains, P-EAGLE's parallel drafts and DFlash's "
            f"blocks; a {result['method']} draft's drafting is not replayed yet, so only the direct checks "
            "and training's estimate against vLLM's ran",
        }
    result |= {"verdict": "pass" if not findings else "gap", "findings": [f.__dict__ for f in findings]}
    log.info(
        "mean acceptance length: vLLM %.3f, replay %s, training estimate %s",
        served["mean_acceptance_length"],
        "not available"
        if result["replay"] is None
        else f"{result['replay']['mean_acceptance_length']:.3f} "
        f"(every anchor {result['replay_every_anchor']['mean_acceptance_length']:.3f})",
        f"{estimate:.3f}" if estimate is not None else "none",
    )
    for f in findings:
        log.warning("parity: %s: %s. Check: %s", f.check, f.detail, f.what_to_check)
    write_json(out, result)
    if findings and cfg.on_gap == "fail":
        # A failed job's outputs are removed: the report stays next to the job's log.
        kept = Path(extraction.log_path).with_suffix(".json")
        write_json(kept, result)
        raise ParityError(
            f"parity failed ({', '.join(f.check for f in findings)}): "
            + "; ".join(f.detail for f in findings)
            + f". The report is kept in {kept}"
        )
    return result
