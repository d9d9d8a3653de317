"""What a training step of each draft method costs on a finished run's own data.

    .venv/bin/python bench/method_step.py --workdir DIR [--methods eagle3 peagle dflash] [--steps 4] [--threads 2]

Reads a finished run of the config in DIR (its prepared verifier, hidden-state shards and the
default draft's vocabulary) and, per method (`train.method`, train/methods/), builds the draft
as training does, packs the run's training samples in its alignment at `train.batch_tokens`, and
times `--steps` whole steps of the loop's own `train_step` (forward, backward, the configured
optimizer) on the first packed batches. Prints a Markdown row per method: trainable parameters,
each step's seconds (the first warms up), and the median of the others.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workflow"))  # the eagleflow package

from devkit.runs import FinishedRun
from eagleflow.common.config import typed
from eagleflow.train.config import TrainConfig
from eagleflow.train.data import ShardSamples, pack
from eagleflow.train.device import Runtime
from eagleflow.train.methods import METHODS, DraftSpec, method_attn_impl
from eagleflow.train.optimizer import build_optimizer
from eagleflow.train.steps import packed_batch, train_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("."))
    parser.add_argument("--configfile", nargs="*", default=[])
    parser.add_argument("--methods", nargs="+", default=["eagle3", "peagle", "dflash"], choices=sorted(METHODS))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    run = FinishedRun.of(args.workdir, args.configfile)
    from safetensors.torch import load_file

    vocab = load_file(str(run.run / "vocab/default/vocab_map.safetensors"))
    print("| method | trainable params | step times, s (first: warm-up) | median, s |")
    print("| --- | ---: | --- | ---: |")
    for name in args.methods:
        method = METHODS[name]
        cfg = typed(TrainConfig, {**run.config["train"], "method": name}, "train")
        source = ShardSamples.from_index(run.run / "hidden_states/index.json", t2d=vocab["t2d"], align=method.align)
        train, _ = source.refs(cfg.sample_fraction)
        rt = Runtime(0, 1, torch.device("cpu"), method_attn_impl(method, "doc_sdpa"), "eager")
        torch.manual_seed(cfg.seed)
        spec = DraftSpec(run.verifier, vocab["d2t"], vocab["t2d"], source.aux_layer_ids, rt.attn_impl)
        model = method.build(spec, cfg)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = build_optimizer(model, cfg.optimizer, cfg.lr, cfg.weight_decay)
        fwd, keys = method.forward_kwargs(cfg, rt.loss_implementation), method.metric_keys(cfg)
        times = []
        for batch in pack(train, cfg.batch_tokens, shuffle_seed=cfg.seed)[: args.steps]:
            inputs = packed_batch(source.samples([train[i] for i in batch]), cfg.batch_tokens, rt)
            started = time.perf_counter()
            train_step(model, params, optimizer, inputs, rt, fwd, lr=cfg.lr, loss_scale=1.0, grad_clip=1.0, keys=keys)
            times.append(time.perf_counter() - started)
        shown = ", ".join(f"{t:.2f}" for t in times)
        print(
            f"| {name} | {sum(p.numel() for p in params) / 1e6:.2f} M | {shown} | {statistics.median(times[1:]):.2f} |"
        )


if __name__ == "__main__":
    main()
