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
    # Of those, what the hidden states' store already holds (stored_samples): the phase
    # extracts the rest only.
    stored_samples: int = 0
    stored_tokens: int = 0

    @property
    def new_samples(self) -> int:
        return self.samples - self.stored_samples

    @property
    def new_tokens(self) -> int:
        return self.tokens - self.stored_tokens


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
        return stored_samples(tokens_from_dataset(dataset), root / f"results/{config['run']}/hidden_states", dataset)
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


def stored_samples(tokens: Tokens, states_dir: Path, dataset: list[Path]) -> Tokens:
    """`tokens` with the samples of `dataset` that the hidden states' store holds under the
    settings of the last extraction (its part manifests' settings key; hidden_states.run):
    what a grown or corrected dataset does not extract again. A settings change since then
    (other layers, dtype, verifier, code) extracts every sample, which the plan cannot tell
    before the jobs key their samples: it counts on the last settings and says so."""
    import dataclasses
    import json

    import pyarrow.parquet as pq

    from eagleflow.hidden_states.sample_keys import sample_key
    from eagleflow.runtime.state_store import PART_GLOB, STORE_DIR, BucketSampleStore, SampleStore

    manifests = [json.loads(p.read_text()) for p in sorted(states_dir.glob(PART_GLOB))]
    made_by = {m.get("settings_key") for m in manifests}
    stores = {m.get("store") for m in manifests}
    if len(made_by) != 1 or None in made_by or len(stores) != 1:
        return tokens  # nothing extracted yet, or parts of different settings: count every sample
    (location,) = stores
    # A bucket's store is listed once (the credentials of the environment, as the jobs have them).
    key, store = made_by.pop(), BucketSampleStore(location) if location else SampleStore(states_dir / STORE_DIR)
    n = t = 0
    for path in dataset:
        table = pq.read_table(path, columns=["input_ids", "loss_mask"])
        ids, masks = (table.column(c).combine_chunks() for c in ("input_ids", "loss_mask"))
        offsets, id_values = ids.offsets.to_numpy(), ids.values.to_numpy()
        mask_offsets, mask_values = masks.offsets.to_numpy(), masks.values.to_numpy()
        for i in range(len(table)):
            a, b = offsets[i], offsets[i + 1]
            mask = mask_values[mask_offsets[i] : mask_offsets[i + 1]]
            if store.has(sample_key(key, id_values[a:b], mask)):
                n, t = n + 1, t + int(b - a)
    source = f"{tokens.source}; {n} samples stored under the last extraction's settings"
    return dataclasses.replace(tokens, stored_samples=n, stored_tokens=t, source=source)
