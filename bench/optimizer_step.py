"""What `train.optimizer` costs a training step: the draft's forward and backward on one packed
batch, and each optimizer's step, on the demo's draft geometry.

    .venv/bin/python bench/optimizer_step.py [--batch-tokens 512 1024] [--repeats 10] [--threads 2]
        [--optimizers adamw muon torch-muon]
    python -m devkit.cpu_features avx2 -- .venv/bin/python bench/optimizer_step.py   # as on AVX2 only

Muon orthogonalises every update of the draft's hidden matrices with Newton-Schulz iterations,
a cost set by the matrices' shapes, not the batch: larger steps spread it over more tokens (for
the Kimi draft an estimated 180 TFLOP a step on every rank, config/README.md). torch.optim.Muon
runs the iterations in bfloat16, eagleflow's on a CPU in float32 (train.optimizer.CpuMuon): a
CPU without bf16 units runs a bfloat16 matmul on a reference path. AdamW's step is elementwise.
Prints the machine's bfloat16 and float32 time of one of the iterations' products (576 x 1536 by
1536 x 576), then one Markdown row per batch size: milliseconds of forward+backward, of each
optimizer's step (Muon both ways), and the whole step's time with each Muon over AdamW's.
Medians of `--repeats` timed calls after two untimed ones; the optimizers' steps are timed
A B C C B A.
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

# (label, train.optimizer, the Muon class that steps it): eagleflow's on a CPU, then torch's own.
KINDS = (("AdamW", "adamw", None), ("Muon f32", "muon", None), ("Muon bf16 (torch)", "muon", torch.optim.Muon))
# --optimizers' names for them (torch's bf16 Muon takes minutes a step where the CPU has no bf16 units).
KIND_NAMES = dict(zip(("adamw", "muon", "torch-muon"), KINDS, strict=True))


def optimizer(model, kind: str, muon_class):
    opt = build_optimizer(model, kind, 1e-6, 0.0)
    if muon_class is not None:
        opt.optimizers[0].__class__ = muon_class  # the same groups and state, stepped by torch
    return opt


def matmul_ms(dtype: torch.dtype, repeats: int) -> float:
    """One product of Newton-Schulz's shapes on the draft's matrices, in `dtype`."""
    a, b = torch.randn(576, 1536, dtype=dtype), torch.randn(1536, 576, dtype=dtype)
    return timed_ms(lambda: a @ b, repeats)


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
    ap.add_argument("--optimizers", nargs="+", choices=list(KIND_NAMES), default=list(KIND_NAMES))
    args = ap.parse_args()
    kinds = tuple(KIND_NAMES[name] for name in dict.fromkeys(["adamw", *args.optimizers]))  # AdamW: the ratios' base

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
        f32, bf16 = matmul_ms(torch.float32, args.repeats), matmul_ms(torch.bfloat16, args.repeats)
        print(
            f"draft: {sum(p.numel() for p in model.parameters() if p.requires_grad) / 1e6:.2f}M trainable; "
            f"{args.threads} threads, median of {args.repeats}; "
            f"CPU capability {torch.backends.cpu.get_cpu_capability()}, "
            f"576x1536 @ 1536x576: float32 {f32:.2f} ms, bfloat16 {bf16:.2f} ms ({bf16 / f32:.1f}x)\n"
        )
        labels = [label for label, _, _ in kinds]
        print(
            f"| batch tokens | forward+backward ms | {' | '.join(f'{x} step ms' for x in labels)} | "
            f"{' | '.join(f'step with {x} / with AdamW' for x in labels[1:])} |"
        )
        print(f"| ---: | ---: | {' | '.join('---:' for _ in labels)} | {' | '.join('---:' for _ in labels[1:])} |")
        for tokens in args.batch_tokens:
            batch = collate([train[i] for i in pack(train, tokens, None)[0]], tokens)

            def forward_backward(batch=batch):
                model.zero_grad(set_to_none=True)
                _, loss, _ = model(**batch, **kwargs)
                loss.backward()

            fb = timed_ms(forward_backward, args.repeats)
            # A B C C B A: every optimizer's step sees the same drift of the machine.
            times: dict[str, list[float]] = {label: [] for label in labels}
            for label, kind, muon_class in (*kinds, *reversed(kinds)):
                times[label].append(timed_ms(optimizer(model, kind, muon_class).step, args.repeats))
            step = {label: statistics.median(t) for label, t in times.items()}
            ratios = [(fb + step[x]) / (fb + step["AdamW"]) for x in labels[1:]]
            print(
                f"| {tokens} | {fb:.0f} | {' | '.join(f'{step[x]:.1f}' for x in labels)} | "
                f"{' | '.join(f'{r:.2f}' for r in ratios)} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
