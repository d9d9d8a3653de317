"""What `train.optimizer` costs a training step: the draft's forward and backward on one packed
batch, and each optimizer's step, on the demo's draft geometry.

    .venv/bin/python bench/optimizer_step.py [--batch-tokens 512 1024] [--repeats 10] [--threads 2]

Muon orthogonalises every update of the draft's hidden matrices with Newton-Schulz iterations
(torch.optim.Muon runs them in bfloat16), a cost set by the matrices' shapes, not the batch:
larger steps spread it over more tokens (for the Kimi draft an estimated 180 TFLOP a step on
every rank, config/README.md). AdamW's step is elementwise. Prints one Markdown row per batch
size: milliseconds of forward+backward, of each optimizer's step, and the whole step's time
with Muon over AdamW's. Medians of `--repeats` timed calls after two untimed ones; the
optimizers' steps are timed A B B A.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workflow"))  # the eagleflow package

from bench.train_overhead import bare_draft, smollm2_geometry_verifier
from devkit.train_inputs import make_train_inputs
from eagleflow.train.data import collate, pack
from eagleflow.train.optimizer import build_optimizer

KINDS = ("adamw", "muon")


def timed_ms(fn, repeats: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - t))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-tokens", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    cfg = yaml.safe_load((Path(__file__).resolve().parents[1] / "config" / "config.yaml").read_text())["train"]
    with tempfile.TemporaryDirectory(prefix="eagleflow-optimizer-step-") as tmp:
        tmp = Path(tmp)
        verifier = smollm2_geometry_verifier(tmp / "verifier")
        lengths = [max(args.batch_tokens)] * 2
        inputs = make_train_inputs(tmp / "in", verifier, lengths, [256, 256], draft_vocab=4096)
        torch.manual_seed(0)
        model, train, kwargs = bare_draft(inputs, verifier, cfg)
        model.train()
        print(
            f"draft: {sum(p.numel() for p in model.parameters() if p.requires_grad) / 1e6:.2f}M trainable; "
            f"{args.threads} threads, median of {args.repeats}\n"
        )
        print("| batch tokens | forward+backward ms | AdamW step ms | Muon step ms | step with Muon / with AdamW |")
        print("| ---: | ---: | ---: | ---: | ---: |")
        for tokens in args.batch_tokens:
            batch = collate([train[i] for i in pack(train, tokens, None)[0]], tokens)

            def forward_backward(batch=batch):
                model.zero_grad(set_to_none=True)
                _, loss, _ = model(**batch, **kwargs)
                loss.backward()

            fb = timed_ms(forward_backward, args.repeats)
            # A B B A: both optimizers' steps see the same drift of the machine.
            times: dict[str, list[float]] = {kind: [] for kind in KINDS}
            for kind in (*KINDS, *reversed(KINDS)):
                opt = build_optimizer(model, kind, 1e-6, 0.0)
                times[kind].append(timed_ms(opt.step, args.repeats))
            step = {kind: statistics.median(t) for kind, t in times.items()}
            ratio = (fb + step["muon"]) / (fb + step["adamw"])
            print(f"| {tokens} | {fb:.0f} | {step['adamw']:.1f} | {step['muon']:.1f} | {ratio:.2f} |", flush=True)


if __name__ == "__main__":
    main()
