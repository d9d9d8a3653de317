"""A peer's draft on the same data: speculators' own trainer, with its defaults, on a finished run.

    .venv/bin/python bench/peer_draft.py --workdir DIR [--configfile my.yaml ...] [--variant NAME] [--out OUT]

Reads a finished run of the config in DIR (its prepared verifier, the dataset's train split,
the hidden states and the vocabulary of a variant's draft, `default` unless --variant
says) and trains a draft of the variant's method (`train.method`: speculators'
`--speculator-type`, with the variant's `num_depths` for P-EAGLE and `block_size` for DFlash)
the way a user of speculators 0.9.0 would, through its console entry points:

1. `speculators prepare-data` on the run's train rows as they are (`input_ids`, `loss_mask`:
   speculators passes such rows through without rendering; it shuffles them and counts the
   loss tokens' frequencies into `token_freq.pt`). `--seq-length` is the longest row, so no
   row is cut.
2. The hidden states rewritten as the files its trainer reads (the `file` hidden-state backend):
   `data/hidden_states/hs_<i>.safetensors` for row i of the prepared dataset, `hidden_states`
   [tokens, aux + 1, hidden] (the aux states in layer order, then the final pre-norm state:
   the convention both sides share) and `token_ids`. Rows are matched to indexed samples by
   their tokens. The eval split is not given to it: it stays held out for the benchmark.
3. `speculators train` with only what points it at that: the data, the verifier, the save
   path, the states' aux layer ids, and the run's draft shape (`train.num_layers` decoder
   layers, Llama-style, and the draft vocabulary's size, which speculators picks itself from
   `token_freq.pt`). The rest is speculators' default: 20 epochs, packed 8192-token batches,
   90% of the rows for training and 10% for validation, Muon + AdamW at lr 1e-3 with linear
   decay, 3 TTT steps, KL loss, a 2048-token sliding window, flex attention, the fused
   (Triton) loss, bf16 autocast.
4. The checkpoint with the lowest validation loss (`checkpoints/checkpoint_best`, speculators'
   `--save-best`: what its user serves), or with `--checkpoint last` the last epoch's (the
   draft at eagleflow's step count: speculators' KL validation loss can bottom out epochs
   before its accepted-token estimate does), without its optimizer state, copied to
   OUT/draft: a speculators-format directory that vLLM serves with `--speculative-config
   '{"method": "eagle3", "model": "OUT/draft", ...}'`, like the run's own draft. With the
   default OUT, `bench/standard_sets.py --draft speculators` measures it on the standard sets.

The training budget is eagleflow's: the tokens the variant's own draft saw (the sum of its
`train/metrics.jsonl`) set the epochs, counted over the 90% of the rows speculators trains on
(`--epochs N` sets them instead; speculators' own default is 20). `--total-seq-len 512` steps at
the run's own batch size, so both trainers take about as many steps. The trainer's wall and CPU time,
the epochs and the tokens go to OUT/peer.json.

A rerun resumes: prepare-data skips a dataset it already wrote, only missing state files are
written, and speculators resumes from its last checkpoint. speculators' trainer has no device
flag and moves the draft to device 0: on a machine without an accelerator the script runs it
through `bench/speculators_on_cpu.py`, which hands it the CPU, with the flags a CPU needs
(`--loss-implementation eager --draft-attn-impl sdpa --num-workers 0`). Nothing
under DIR is written except OUT (default: results/<run>/drafts/speculators/, and
speculators-<variant>/ for another variant, with `-last` for the last epoch's draft).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workflow"))  # the eagleflow package

from devkit.runs import FinishedRun
from eagleflow.common.atomic import atomic_path, write_jsonl, write_safetensors
from eagleflow.dag.variants import draft_id, variant_config, vocab_id
from eagleflow.hidden_states.shard_reader import ShardReader
from eagleflow.runtime.logs import configure_logging

log = logging.getLogger("peer_draft")


def tokens_key(input_ids: np.ndarray) -> bytes:
    """A row's identity for matching prepared rows to indexed samples: a digest of its tokens."""
    return hashlib.blake2b(np.asarray(input_ids, dtype=np.int64).tobytes(), digest_size=16).digest()


BENCH = Path(__file__).resolve().parent
TRAIN_DATA_RATIO = 0.9  # speculators' default share of the rows it trains on (the rest validates)
CPU_TRAIN_FLAGS = (
    *("--loss-implementation", "eager", "--draft-attn-impl", "sdpa", "--num-workers", "0"),
    *("--hidden-states-dtype", "float32"),
)


def speculators(*args: str, cwd: Path) -> None:
    """Run a `speculators` command with this interpreter (`train` without an accelerator through
    the CPU adapter); its output goes to ours, a failure stops the script with its exit status."""
    cmd = [sys.executable, "-m", "speculators", *args]
    if args[0] == "train" and torch.accelerator.current_accelerator() is None:
        cmd = [sys.executable, str(BENCH / "speculators_on_cpu.py"), *args[1:], *CPU_TRAIN_FLAGS]
    log.info("running: %s", " ".join(cmd))
    rc = subprocess.run(cmd, cwd=cwd).returncode
    if rc:
        raise SystemExit(f"speculators {args[0]} failed with exit status {rc} (its output is above)")


def write_train_rows(train_parquet: Path, out: Path) -> tuple[int, int]:
    """The run's train rows as prepare-data reads pre-tokenized rows (JSONL of `input_ids`,
    `loss_mask`); returns the longest row's length and the rows' tokens."""
    table = pq.read_table(train_parquet, columns=["input_ids", "loss_mask"]).to_pylist()
    write_jsonl(out, table)
    lengths = [len(row["input_ids"]) for row in table]
    return max(lengths), sum(lengths)


def children_cpu_s() -> float:
    """CPU seconds (user and system) of this process's finished children."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def tokens_seen(metrics: Path) -> int:
    """The tokens a finished eagleflow training stepped on: the sum of its train rows'."""
    if not metrics.exists():
        raise SystemExit(f"{metrics} is missing: train the run's default draft first (or pass --epochs)")
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return sum(row["tokens"] for row in rows if row.get("split") == "train")


def shard_index(run: Path) -> dict:
    """The hidden-state index, refused when its states lack what speculators trains on."""
    index_path = run / "hidden_states/index.json"
    if not index_path.exists():
        raise SystemExit(
            f"{index_path} is missing: the run has no hidden states (hidden_states.mode: online?). "
            "speculators' trainer would compute the states through a vLLM server with its hidden-state "
            "connector (--vllm-endpoint), which this script does not start."
        )
    index = json.loads(index_path.read_text())
    if index["target_topk"]:
        raise SystemExit(
            f"{index_path}: the states keep the verifier's top-{index['target_topk']} logits instead of its "
            "final state (hidden_states.target: topk); speculators trains on the final state"
        )
    return index


def write_state_files(data: Path, run: Path, index: dict) -> None:
    """hs_<i>.safetensors for every row i of the prepared dataset that lacks one, from the
    indexed sample with the same tokens (read one at a time: a run's states need not fit in
    memory)."""
    from datasets import load_from_disk

    rows: dict[bytes, list[int]] = {}
    for i, row in enumerate(load_from_disk(str(data)).with_format("numpy", columns=["input_ids"])):
        rows.setdefault(tokens_key(row["input_ids"]), []).append(i)
    out = data / "hidden_states"
    missing = {i for indices in rows.values() for i in indices if not (out / f"hs_{i}.safetensors").exists()}
    log.info("%d prepared rows, %d state files to write", sum(map(len, rows.values())), len(missing))
    hidden = index["hidden_size"]
    for entry in index["samples"]:
        if not missing:
            break
        s = ShardReader(run / "hidden_states" / entry["file"]).sample(int(entry["row"]), torch.bfloat16)
        todo = [i for i in rows.get(tokens_key(s.input_ids.numpy()), []) if i in missing]
        if not todo:
            continue
        n = len(s.input_ids)
        states = torch.cat([s.aux.view(n, -1, hidden), s.final.view(n, 1, hidden)], dim=1)
        for i in todo:
            write_safetensors(out / f"hs_{i}.safetensors", {"hidden_states": states, "token_ids": s.input_ids})
            missing.discard(i)
    if missing:
        raise SystemExit(
            f"{len(missing)} prepared rows have no sample with the same tokens in the hidden states of {run}"
        )


def draft_vocab_size(vocab_map: Path) -> int:
    """The size of the run's draft vocabulary (the length of its d2t)."""
    with safe_open(str(vocab_map), framework="pt") as f:
        return f.get_slice("d2t").get_shape()[0]


def chosen_checkpoint(checkpoints: Path, which: str) -> Path:
    """The epoch directory `which` names: `best` (speculators' checkpoint_best, the lowest
    validation loss) or `last` (the highest epoch saved)."""
    if which == "best":
        best = checkpoints / "checkpoint_best"
        if not best.exists():
            raise SystemExit(f"{best} is missing: speculators train wrote no checkpoint with a validation loss")
        return best.resolve()
    epochs = [d for d in checkpoints.iterdir() if d.is_dir() and d.name.isdigit()]
    if not epochs:
        raise SystemExit(f"{checkpoints} holds no epoch checkpoint: speculators train saved none")
    return max(epochs, key=lambda d: int(d.name))


def export_draft(checkpoint: Path, draft: Path) -> None:
    """A checkpoint's weights and config, without optimizer state, as `draft`."""
    with atomic_path(draft) as tmp:
        shutil.copytree(checkpoint, tmp, ignore=shutil.ignore_patterns("*.pt"))
    log.info("draft: %s (from epoch %s)", draft, checkpoint.name)


def method_shape(train: dict) -> list[str]:
    """speculators' flags for the shape a method's draft takes from the variant's train section:
    P-EAGLE's depths, DFlash's block (EAGLE-3's chain length is speculators' own default, 3)."""
    return {
        "peagle": ["--num-depths", str(train["num_depths"])],
        "dflash": ["--block-size", str(train["block_size"])],
        "dspark": ["--block-size", str(train["block_size"])],
    }.get(train["method"], [])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("."))
    parser.add_argument("--configfile", nargs="*", default=[])
    parser.add_argument(
        "--variant", default="default", help="the variant whose method, shape and budget the peer takes"
    )
    parser.add_argument(
        "--out", type=Path, help="default: results/<run>/drafts/speculators[-<variant>] under the workdir"
    )
    parser.add_argument("--epochs", type=int, help="default: the tokens eagleflow's default draft saw")
    parser.add_argument(
        "--checkpoint",
        choices=("best", "last"),
        default="best",
        help="the lowest validation loss (speculators' --save-best) or the last epoch (eagleflow's step count)",
    )
    parser.add_argument(
        "--total-seq-len",
        type=int,
        help="speculators' tokens per step (default: its own, 8192); the run's train.batch_tokens: eagleflow's steps",
    )
    args = parser.parse_args()
    configure_logging(sys.stderr)
    finished = FinishedRun.of(args.workdir, args.configfile)
    config, run, verifier = finished.config, finished.run, finished.verifier
    train, draft = variant_config(config, args.variant)["train"], draft_id(config, args.variant)
    suffix = ("" if args.variant == "default" else f"-{args.variant}") + ("-last" if args.checkpoint == "last" else "")
    out = (args.out or run / f"drafts/speculators{suffix}").resolve()
    remote_code = ["--trust-remote-code"] if config["verifier"]["trust_remote_code"] else []
    index = shard_index(run)
    data = out / "data"

    max_len, train_tokens = write_train_rows(run / "dataset/train.parquet", out / "train.jsonl")
    budget = tokens_seen(run / f"drafts/{draft}/train/metrics.jsonl") if args.epochs is None else None
    epochs = args.epochs or max(1, round(budget / (TRAIN_DATA_RATIO * train_tokens)))
    log.info("%d epochs over %d train tokens (eagleflow's draft saw %s)", epochs, train_tokens, budget)
    speculators(
        "prepare-data",
        *("--model", verifier, "--data", str(out / "train.jsonl"), "--output", str(data)),
        *("--seq-length", str(max_len), "--no-skip-token-freq", *remote_code),
        cwd=out,
    )
    write_state_files(data, run, index)
    started = time.monotonic()
    cpu_before = children_cpu_s()
    speculators(
        "train",
        *("--verifier-name-or-path", verifier, *remote_code, "--data-path", str(data)),
        *("--save-path", str(out / "checkpoints"), "--target-layer-ids", *map(str, index["aux_layer_ids"])),
        *("--speculator-type", train["method"], *method_shape(train)),
        *("--num-layers", str(train["num_layers"])),
        *(
            "--draft-vocab-size",
            str(draft_vocab_size(run / f"vocab/{vocab_id(config, args.variant)}/vocab_map.safetensors")),
        ),
        *("--epochs", str(epochs)),
        *(("--total-seq-len", str(args.total_seq_len)) if args.total_seq_len else ()),
        *(("--save-best",) if args.checkpoint == "best" else ()),
        cwd=out,
    )
    wall_s = time.monotonic() - started
    cpu_s = children_cpu_s() - cpu_before
    checkpoint = chosen_checkpoint(out / "checkpoints", args.checkpoint)
    export_draft(checkpoint, out / "draft")
    summary = {"variant": args.variant, "method": train["method"], "epochs": epochs, "train_tokens": train_tokens}
    summary |= {"checkpoint": args.checkpoint, "exported_epoch": int(checkpoint.name)}
    summary |= {"eagleflow_tokens_seen": budget}
    summary |= {"total_seq_len": args.total_seq_len, "train_wall_s": wall_s, "train_cpu_s": cpu_s}  # null: its default
    with atomic_path(out / "peer.json") as tmp:
        tmp.write_text(json.dumps(summary, indent=1) + "\n")
    log.info("speculators train: %.0f s; %s", wall_s, out / "peer.json")


if __name__ == "__main__":
    main()
