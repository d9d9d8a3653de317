"""What a prompt set is cleaned of before the verifier answers it, in this order:

1. `not_ended`: a written conversation whose turns did not all end (cut at max_tokens) or
   that a failed request ended;
2. `length`: a user turn shorter than `min_chars` or longer than `max_chars`;
3. `not_text`: a turn whose text score is below `min_text_score` (`text_score`);
4. `duplicate`: the same conversation as an earlier one, up to case, spacing and punctuation;
5. `near_duplicate`: Jaccard similarity of character 5-grams of at least `near_duplicate` to an
   earlier kept conversation (datasketch's MinHash LSH finds the candidates; the exact Jaccard of
   the shingle sets decides);
6. `benchmark`: a turn with that similarity at `benchmark_overlap` or more to a turn of
   a benchmark set's item (MT-Bench, HumanEval, a prompt file set), so the evaluation stays
   honest.

Each removed conversation is kept with its reason and what it matched, for the report.
Deterministic: the order of the input decides which of two duplicates stays. Pure.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable
from typing import Any

from eagleflow.prompts.config import FilterConfig

NUM_PERM = 128
SHINGLE = 5  # characters
REPEAT_NGRAM = 3  # words, for the text score
WORD = re.compile(r"\w+", re.UNICODE)
# Unicode categories of characters that are not text: controls, unassigned, private use, surrogates.
NOT_TEXT_CATEGORIES = ("Cc", "Cn", "Co", "Cs")


REASONS = ("not_ended", "length", "not_text", "duplicate", "near_duplicate", "benchmark")


def words(text: str) -> list[str]:
    return WORD.findall(text.lower())


def shingles(text: str) -> set[str]:
    """Character 5-grams of the normalised text (its words, lowercased, single-spaced): on
    prompts of a dozen words, word n-grams change wholesale with one inserted word."""
    normal = " ".join(words(text))
    if len(normal) < SHINGLE:
        return {normal} if normal else set()
    return {normal[i : i + SHINGLE] for i in range(len(normal) - SHINGLE + 1)}


def jaccard(a: set[str], b: set[str]) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


def text_score(text: str) -> float:
    """How much `text` reads as text, in [0, 1]: the product of
    - the share of characters that are not controls, unassigned, private-use or replacement
      characters (bytes decoded wrongly, a tokenizer's debris);
    - twice the share of letters and digits among the other non-space characters, capped at 1
      (punctuation soup scores low; prose, arithmetic and code score 1);
    - one less the share of repeated word 3-grams (a turn stuck in a loop scores near 0).
    """
    if not text.strip():
        return 0.0
    clean = sum(1 for c in text if c in "\n\t" or unicodedata.category(c) not in NOT_TEXT_CATEGORIES and c != "\ufffd")
    visible = [c for c in text if not c.isspace()]
    alnum = sum(1 for c in visible if c.isalnum()) / len(visible)
    w = words(text)
    grams = [tuple(w[i : i + REPEAT_NGRAM]) for i in range(len(w) - REPEAT_NGRAM + 1)]
    repeated = 1 - len(set(grams)) / len(grams) if grams else 0.0
    return (clean / len(text)) * min(1.0, 2 * alnum) * (1 - repeated)


def conversation_text(prompt: dict[str, Any]) -> str:
    return "\n".join(prompt["turns"])


def exact_key(prompt: dict[str, Any]) -> str:
    """The conversation up to case, spacing and punctuation."""
    return "\x1f".join(" ".join(words(t)) for t in prompt["turns"])


class BenchmarkIndex:
    """Every turn of the benchmark sets' items, searchable by Jaccard similarity."""

    def __init__(self, items: Iterable[tuple[str, str]], threshold: float):
        from datasketch import MinHashLSH

        self.threshold = threshold
        self.lsh = MinHashLSH(threshold=threshold, num_perm=NUM_PERM)
        self.shingles: dict[str, set[str]] = {}
        self.text: dict[str, str] = {}
        for key, text in items:
            s = shingles(text)
            if not s or key in self.shingles:
                continue
            self.shingles[key], self.text[key] = s, text
            self.lsh.insert(key, minhash(s))

    def closest(self, text: str) -> tuple[str, float] | None:
        """(the benchmark item, its similarity) of the most similar item at or above the threshold."""
        s = shingles(text)
        if not s:
            return None
        found = [(k, jaccard(s, self.shingles[k])) for k in self.lsh.query(minhash(s))]
        found = [f for f in found if f[1] >= self.threshold]
        return max(found, key=lambda f: (f[1], f[0])) if found else None


def minhash(s: set[str]):
    from datasketch import MinHash

    m = MinHash(num_perm=NUM_PERM, seed=1)
    m.update_batch(x.encode() for x in sorted(s))
    return m


def apply_filters(
    prompts: list[dict[str, Any]], cfg: FilterConfig, benchmark: BenchmarkIndex | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(kept prompts, removed ones as {prompt, reason, detail}) in input order."""
    from datasketch import MinHashLSH

    kept, removed = [], []
    seen: dict[str, str] = {}
    lsh = MinHashLSH(threshold=cfg.near_duplicate, num_perm=NUM_PERM) if cfg.near_duplicate else None
    # Keyed by position: ids are checked for uniqueness later (the split), not here.
    kept_shingles: dict[str, tuple[str, set[str]]] = {}

    def drop(prompt, reason, detail):
        removed.append({"prompt": prompt, "reason": reason, "detail": detail})

    for i, p in enumerate(prompts):
        if p.get("ended") is not None and (not all(p["ended"]) or p.get("error")):
            drop(p, "not_ended", p.get("error") or "a turn hit max_tokens before its end-of-turn token")
            continue
        lengths = [len(t) for t in p["turns"]]
        if min(lengths) < cfg.min_chars or max(lengths) > cfg.max_chars:
            drop(p, "length", f"turn lengths {lengths} chars, outside [{cfg.min_chars}, {cfg.max_chars}]")
            continue
        score = min(text_score(t) for t in p["turns"])
        if score < cfg.min_text_score:
            drop(p, "not_text", f"text score {score:.2f} < {cfg.min_text_score}")
            continue
        key = exact_key(p)
        if key in seen:
            drop(p, "duplicate", f"same as {seen[key]}")
            continue
        s = shingles(conversation_text(p))
        if lsh is not None and s:
            m = minhash(s)
            near = [(jaccard(s, kept_shingles[k][1]), kept_shingles[k][0]) for k in lsh.query(m)]
            near = [n for n in near if n[0] >= cfg.near_duplicate]
            if near:
                sim, other = max(near)
                drop(p, "near_duplicate", f"Jaccard {sim:.2f} to {other}")
                continue
        if benchmark is not None:
            hits = [h for h in (benchmark.closest(t) for t in p["turns"]) if h is not None]
            if hits:
                item, sim = max(hits, key=lambda h: h[1])
                drop(p, "benchmark", f"Jaccard {sim:.2f} to {item}")
                continue
        seen[key] = p["id"]
        if lsh is not None and s:
            lsh.insert(str(i), m)
            kept_shingles[str(i)] = (p["id"], s)
        kept.append(p)
    return kept, removed
