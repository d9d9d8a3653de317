"""Synthetic train-stage inputs (hidden-state shards, index.json, vocab map, and the dataset
online mode reads) for a verifier dir.

The shards are written by the stage's own writer (hidden_states.shard_file), filled with
seeded random numbers: the training loop's mechanics (packing, steps, checkpoints, data
parallel) do not depend on the hidden states being a real verifier's. The dataset holds the
same tokens and loss masks; online mode computes its states with the real verifier.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from safetensors.torch import save_file
from transformers import AutoConfig

from eagleflow.hidden_states.index import write_index
from eagleflow.hidden_states.shard_file import ShardMeta, write_shard

AUX_LAYERS = 3


def make_train_inputs(
    out: Path,
    verifier_dir: Path,
    train_lengths: list[int],
    eval_lengths: list[int],
    *,
    draft_vocab: int,
    num_shards: int = 2,
    seed: int = 0,
) -> dict[str, object]:
    """Write shards, index.json and vocab_map.safetensors under `out`; return the paths in
    run_train's argument names (and `dataset`: train and eval parquet). Samples are dealt
    round-robin over the shards."""
    cfg = AutoConfig.from_pretrained(verifier_dir)
    hidden, vocab, layers = cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers
    g = torch.Generator().manual_seed(seed)
    samples = [(n, False) for n in train_lengths] + [(n, True) for n in eval_lengths]
    out.mkdir(parents=True, exist_ok=True)
    shards, rows = [], {False: [], True: []}
    for s in range(num_shards):
        mine = samples[s::num_shards]
        total = sum(n for n, _ in mine)
        offsets = [0]
        for n, _ in mine:
            offsets.append(offsets[-1] + n)
        loss_mask = torch.ones(total, dtype=torch.int8)
        for a in offsets[:-1]:
            loss_mask[a : a + 3] = 0  # the prompt part of each sample
        aux = torch.randn(total, AUX_LAYERS * hidden, generator=g).to(torch.bfloat16)
        final = torch.randn(total, hidden, generator=g).to(torch.bfloat16)
        input_ids = torch.randint(0, vocab, (total,), generator=g, dtype=torch.int32)
        ids = [f"s{s}-{i}" for i in range(len(mine))]
        samples_here, states = [], []
        for i, (n, is_eval) in enumerate(mine):
            a = offsets[i]
            sample = {
                "id": ids[i],
                "split": "eval" if is_eval else "train",
                "input_ids": input_ids[a : a + n].tolist(),
                "loss_mask": loss_mask[a : a + n].tolist(),
            }
            samples_here.append(sample)
            states.append((aux[a : a + n], final[a : a + n]))
            row = {
                "id": f"{ids[i]}#t0",
                "input_ids": sample["input_ids"],
                "loss_mask": sample["loss_mask"],
                "length": n,
            }
            rows[is_eval].append(row)
        path = out / f"shard-{s:05d}.safetensors"
        write_shard(path, samples_here, states, ShardMeta(ids, [2, layers // 2, layers - 3], layers, hidden))
        shards.append(str(path))
    index = out / "index.json"
    write_index(shards, str(verifier_dir), str(index))
    # Draft vocab: every other target id (d2t holds offsets target_id - draft_index).
    target_ids = torch.arange(0, 2 * draft_vocab, 2)[:draft_vocab] % vocab
    d2t = target_ids - torch.arange(draft_vocab)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[target_ids] = True
    vocab_map = out / "vocab_map.safetensors"
    save_file({"d2t": d2t.to(torch.int64), "t2d": t2d}, str(vocab_map))
    dataset = []
    for split, is_eval in (("train", False), ("eval", True)):
        dataset.append(str(out / f"{split}.parquet"))
        pq.write_table(pa.Table.from_pylist(rows[is_eval]), dataset[-1])
    return {"shards": shards, "index": str(index), "vocab_map": str(vocab_map), "dataset": dataset}
