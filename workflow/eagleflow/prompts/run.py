"""The prompts rule's job: the sources (a prompt file, the verifier's written conversations)
filtered together (prompts.filters: the file's prompts first, so a written prompt close to
one of them is the one dropped), mixed by `prompts.weights`, split into train and eval, and
described in `prompts/stats.json` for the report.

Mixing takes from each source its share of the set, as many conversations as the scarcest
source allows; which ones, and their order, follow a hash of their text, so the set is
deterministic and `max_train` keeps the shares. With one source the file's order is kept.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from typing import Any

from eagleflow.common.atomic import read_jsonl, write_json, write_jsonl
from eagleflow.common.config import typed
from eagleflow.common.fingerprint import stable_fraction
from eagleflow.prompts.config import PromptsConfig
from eagleflow.prompts.filters import REASONS, BenchmarkIndex, apply_filters, words
from eagleflow.prompts.load import conversation_key, load_prompts, normalise, split_prompts
from eagleflow.prompts.packaged_sets import read_prompt_set
from eagleflow.runtime.smk import stage

log = logging.getLogger(__name__)

FILE, WRITTEN = "file", "written"
EXAMPLES = 3
LENGTH_EDGES = (0, 8, 16, 32, 64, 128, 256, 512)  # words of a conversation's user turns


def main(smk) -> None:
    """The prompts rule's job (workflow/rules/prompts.smk)."""
    with stage(smk):
        run_prompts(
            smk.input.get("source"),
            smk.input.get("written"),
            smk.output.train,
            smk.output.eval,
            smk.output.stats,
            typed(PromptsConfig, smk.params.prompts, "prompts"),
            smk.params.benchmark_sets,
        )


def benchmark_turns(sets: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(item turn id, text) of every turn of every item of the sets (`name`, and `path` for a
    prompt file), whole sets: a run may measure more of a set than its config's `size`."""
    out = []
    for entry in sets:
        _, prompts = read_prompt_set(entry["name"], entry.get("path"))
        out += [(f"{p['id']}#t{i}", turn) for p in prompts for i, turn in enumerate(p["turns"])]
    return out


def mix(by_source: dict[str, list[dict[str, Any]]], weights: dict[str, float], seed: int) -> list[dict[str, Any]]:
    """Each present source's share (`weights`, normalised over the sources present with a
    weight above 0) of the largest set the sources can fill; a lone source whole, in order.
    Pure."""
    present = {s: rows for s, rows in by_source.items() if rows and weights.get(s, 0) > 0}
    if len(present) <= 1:
        return next(iter(present.values()), [])
    total_weight = sum(weights[s] for s in present)
    shares = {s: weights[s] / total_weight for s in present}
    size = min(math.floor(len(rows) / shares[s] + 1e-9) for s, rows in present.items())

    def order(p: dict[str, Any]) -> float:
        return stable_fraction(f"{seed}:mix", conversation_key(p["system"], p["turns"]))

    # Each source's chosen rows spread evenly over [0, 1) by their rank (the hash breaks the
    # ties): sorted together, the sources interleave in their shares all along the set.
    placed = []
    for s, rows in present.items():
        chosen = sorted(rows, key=order)[: min(len(rows), round(shares[s] * size))]
        placed += [((rank + order(p)) / len(chosen), p) for rank, p in enumerate(chosen)]
    return [p for _, p in sorted(placed, key=lambda x: x[0])]


def describe(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts, length distribution (words of the user turns), distinct n-grams and a few
    examples of a set of conversations. Pure."""
    lengths = [len(words(" ".join(r["turns"]))) for r in rows]
    unigrams, bigrams, total_uni, total_bi = Counter(), Counter(), 0, 0
    for r in rows:
        for turn in r["turns"]:
            w = words(turn)
            unigrams.update(w)
            bigrams.update(zip(w, w[1:], strict=False))
            total_uni, total_bi = total_uni + len(w), total_bi + max(len(w) - 1, 0)
    hist = [0] * len(LENGTH_EDGES)
    for n in lengths:
        hist[max(i for i, edge in enumerate(LENGTH_EDGES) if n >= edge)] += 1
    ordered = sorted(lengths)
    return {
        "conversations": len(rows),
        "turns": sum(len(r["turns"]) for r in rows),
        "words": {
            "mean": round(sum(lengths) / len(lengths), 1) if lengths else None,
            "median": ordered[len(ordered) // 2] if ordered else None,
            "max": ordered[-1] if ordered else None,
            "histogram": {"edges": list(LENGTH_EDGES), "counts": hist},
        },
        "distinct_1": round(len(unigrams) / total_uni, 4) if total_uni else None,
        "distinct_2": round(len(bigrams) / total_bi, 4) if total_bi else None,
        "examples": [r["turns"][0][:300] for r in rows[:EXAMPLES]],
    }


def run_prompts(
    source: str | None,
    written: str | None,
    train_out: str,
    eval_out: str,
    stats_out: str,
    cfg: PromptsConfig,
    benchmark_sets: list[dict[str, Any]],
) -> None:
    loaded = {FILE: [], WRITTEN: []}
    if source:
        loaded[FILE] = [{**p, "source": FILE} for p in load_prompts(source)]
    if written:
        loaded[WRITTEN] = read_jsonl(written)
    index = None
    if cfg.filters.benchmark_overlap is not None and benchmark_sets:
        index = BenchmarkIndex(benchmark_turns(benchmark_sets), cfg.filters.benchmark_overlap)
    kept, removed = apply_filters(loaded[FILE] + loaded[WRITTEN], cfg.filters, index)
    kept = [{**normalise(p, f"{p['source']} prompt {p['id']}"), "source": p["source"]} for p in kept]
    by_source = {s: [p for p in kept if p["source"] == s] for s in loaded}
    mixed = mix(by_source, {FILE: cfg.weights.file, WRITTEN: cfg.weights.written}, cfg.seed)
    train, evals = split_prompts(mixed, cfg.eval_fraction, cfg.seed)
    if cfg.max_train is not None:
        train = train[: cfg.max_train]
    if cfg.max_eval is not None:
        evals = evals[: cfg.max_eval]
    sources = " + ".join(s for s in (source, written) if s)
    if not train or not evals:
        raise ValueError(
            f"{sources}: {len(mixed)} prompts after filters and mixing, split into {len(train)} train and "
            f"{len(evals)} eval; both must be non-empty (prompts.eval_fraction is {cfg.eval_fraction}; "
            f"removed by the filters: {dict(Counter(r['reason'] for r in removed))})"
        )
    write_jsonl(train_out, train)
    write_jsonl(eval_out, evals)
    write_json(stats_out, prompt_stats(loaded, removed, by_source, train, evals, cfg, source, written))
    log.info(
        "%d prompts (%s) -> %d removed by the filters -> %d mixed -> %d train, %d eval",
        sum(len(v) for v in loaded.values()),
        sources,
        len(removed),
        len(mixed),
        len(train),
        len(evals),
    )


def prompt_stats(loaded, removed, by_source, train, evals, cfg: PromptsConfig, source, written) -> dict[str, Any]:
    """What the report shows of the prompt set. Pure."""
    paths = {FILE: source, WRITTEN: written}
    return {
        "sources": {
            s: {
                "path": paths[s],
                "loaded": len(loaded[s]),
                "kept": len(by_source[s]),
                "weight": getattr(cfg.weights, s),
                "train": sum(1 for p in train if p["source"] == s),
                "eval": sum(1 for p in evals if p["source"] == s),
            }
            for s in loaded
            if loaded[s]
        },
        "filters": {
            "settings": {
                "min_chars": cfg.filters.min_chars,
                "max_chars": cfg.filters.max_chars,
                "min_text_score": cfg.filters.min_text_score,
                "near_duplicate": cfg.filters.near_duplicate,
                "benchmark_overlap": cfg.filters.benchmark_overlap,
            },
            "removed": {
                reason: {
                    "count": len(hits := [r for r in removed if r["reason"] == reason]),
                    "by_source": dict(Counter(r["prompt"]["source"] for r in hits)),
                    "examples": [
                        {
                            "id": r["prompt"]["id"],
                            "source": r["prompt"]["source"],
                            "text": " / ".join(r["prompt"]["turns"])[:200],
                            "detail": r["detail"],
                        }
                        for r in hits[:EXAMPLES]
                    ],
                }
                for reason in REASONS
            },
        },
        "train": {s: describe([p for p in train if p["source"] == s]) for s in loaded if loaded[s]},
        "split": {"train": len(train), "eval": len(evals)},
    }
