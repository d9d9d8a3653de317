"""The plan's tokens (eagleflow.plan): exact once the dataset exists, else an upper
bound from the prompts (common.token_estimate)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagleflow.common.token_estimate import CHARS_PER_TOKEN, turn_contexts


@dataclass(frozen=True)
class Tokens:
    """What the hidden-state stage will see: samples and their tokens."""

    samples: int
    tokens: int
    longest: int
    source: str  # where the figures come from, said in the plan


def tokens_from_dataset(paths: list[Path]) -> Tokens:
    import pyarrow.parquet as pq

    lengths = [n for p in paths for n in pq.read_table(p, columns=["length"]).column("length").to_pylist()]
    return Tokens(len(lengths), sum(lengths), max(lengths, default=0), "exact: " + ", ".join(map(str, paths)))


def tokens_from_prompts(prompts: list[dict[str, Any]], max_tokens: int, max_seq_len: int, source: str) -> Tokens:
    """Upper bound: one sample per turn, holding every earlier turn and reply
    (common.token_estimate), cut at `max_seq_len`. Pure."""
    lengths = [min(context, max_seq_len) for p in prompts for context in turn_contexts(p, max_tokens)]
    return Tokens(len(lengths), sum(lengths), max(lengths, default=0), source)


def planned_tokens(config: dict[str, Any], root: Path, assume_prompt_tokens: int) -> Tokens:
    """Exact tokens from the dataset when it exists, else the upper bound from the prompts."""
    dataset = [root / f"results/{config['run']}/dataset/{split}.parquet" for split in ("train", "eval")]
    if all(p.exists() for p in dataset):
        return tokens_from_dataset(dataset)
    max_tokens, cut = config["generate"]["max_tokens"], config["dataset"]["max_seq_len"]
    prompts_cfg = config["prompts"]
    split = root / f"results/{config['run']}/prompts/train.jsonl"
    if split.exists():
        from eagleflow.common.atomic import read_jsonl

        train = read_jsonl(split)
        how = f"upper bound: the {len(train)} train prompts of {split}, every reply at generate.max_tokens {max_tokens}"
        return tokens_from_prompts(train, max_tokens, cut, how)
    train, hows = [], []
    if prompts_cfg["source"]:
        source = root / prompts_cfg["source"]
        if source.exists():
            from eagleflow.prompts.load import load_prompts, split_prompts

            train, _ = split_prompts(load_prompts(source), prompts_cfg["eval_fraction"], prompts_cfg["seed"])
            hows.append(f"{len(train)} train prompts of {source}")
        elif prompts_cfg["max_train"] is None:
            raise ValueError(
                f"prompts.source {source} is not on this machine and prompts.max_train is not set: "
                "the plan cannot count the samples"
            )
        else:
            train = [{"turns": ["x" * assume_prompt_tokens * CHARS_PER_TOKEN]}] * prompts_cfg["max_train"]
            hows.append(
                f"assumed: {source} is not on this machine; prompts.max_train single-turn prompts of "
                f"{assume_prompt_tokens} tokens"
            )
    written = prompts_cfg["written"]
    if written["count"]:
        # Every written conversation kept, each turn at its max_tokens.
        n = round(written["count"] * (1 - prompts_cfg["eval_fraction"]))
        train += [{"turns": ["x" * written["max_tokens"] * CHARS_PER_TOKEN] * written["turns"]}] * n
        hows.append(f"{n} written conversations of {written['turns']} turns at {written['max_tokens']} tokens")
    if prompts_cfg["max_train"] is not None:
        train = train[: prompts_cfg["max_train"]]
    how = f"upper bound: {' + '.join(hows)}, every reply at generate.max_tokens {max_tokens}"
    return tokens_from_prompts(train, max_tokens, cut, how)
