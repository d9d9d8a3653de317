"""Train drafts with different schedules on one finished run's data; compare on the eval split.

    python bench/train_schedule.py results/demo \
        '{"epochs": 4, "batch_tokens": 2048, "lr": 0.0006}' \
        '{"epochs": 8, "batch_tokens": 1024, "lr": 0.0008}'

Each JSON object overrides `train` in config/config.yaml; one bench-only key,
`"loss_on_prompts": true`, trains on every position of the training samples (the prompt's
too: the verifier's distribution is a target there as well) where the workflow trains on the
replies only; the eval split stays on its replies. The runs go one after the other (never in
parallel: they would share the 2 cores) and write under /tmp, each draft's directory named in
its row (for `bench/replay_sets.py --draft LABEL=PATH`). Prints one Markdown
row per schedule: steps, wall time, best eval loss, estimated acceptance length (every
anchor: 1 + sum of full_acc_k) and the walk's (the anchors vLLM would visit on the eval split,
the closer figure to vLLM's).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

import eagleflow.train.loop as loop
from eagleflow.common.config import typed
from eagleflow.train.config import TrainConfig, TrainJob
from eagleflow.train.data import ShardSamples

LOSS_ON_PROMPTS = "loss_on_prompts"


class LossOnPrompts(ShardSamples):
    """The states as training reads them, with every position of the training samples in the loss."""

    def samples(self, refs):
        out = super().samples(refs)
        for ref, sample in zip(refs, out, strict=True):
            if not ref.is_eval:
                sample.loss_mask = torch.ones_like(sample.loss_mask)
        return out


def main(run_dir: str, schedules: list[str]) -> None:
    run = Path(run_dir)
    base = yaml.safe_load(Path("config/config.yaml").read_text())
    verifier = f"resources/verifier/{base['verifier']['name']}"
    print("| schedule | steps | train wall s | best eval loss | estimated acceptance | walk acceptance | draft |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for spec in schedules:
        cfg = {**base["train"], **json.loads(spec)}
        loop.ShardSamples = LossOnPrompts if cfg.pop(LOSS_ON_PROMPTS, False) else ShardSamples
        out = Path(tempfile.mkdtemp(prefix="eagleflow-schedule-"))
        started = time.perf_counter()
        job = TrainJob(
            shards=[],  # training reads the states the index names
            vocab_map=str(run / "vocab/default/vocab_map.safetensors"),
            index=str(run / "hidden_states/index.json"),
            verifier_dir=verifier,
            draft_out=str(out / "draft"),
            metrics_out=str(out / "metrics.jsonl"),
            checkpoint_dir=str(out / "checkpoints"),
            serve_verifier_path=verifier,
            threads=2,
        )
        loop.run_train(job, typed(TrainConfig, cfg, "train"))
        wall = time.perf_counter() - started
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        best = min((r for r in rows if r["split"] == "eval"), key=lambda r: r["loss"])
        steps = max(r["step"] for r in rows)
        print(
            f"| {spec} | {steps} | {wall:.0f} | {best['loss']:.3f} | {best['estimated_acceptance_length']:.3f} "
            f"| {best['walk_acceptance_length']:.3f} | {out / 'draft'} |",
            flush=True,
        )


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2:])
