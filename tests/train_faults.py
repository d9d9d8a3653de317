"""A training process that kills itself once a given step is done: how the resume tests stop
a run at a known point. Production wires no step callback; only these tests do.

    python -m tests.train_faults SPEC.json STEP[:SIGNAME]     (SIGKILL by default)
"""

import json
import os
import signal
import sys

import torch.distributed as dist

from eagleflow.runtime.logs import configure_logging
from eagleflow.runtime.process import terminate_on_sigterm
from eagleflow.train.loop import StepCallback, run_from_json


def kill_at(step: int, sig: int = signal.SIGKILL) -> StepCallback:
    def on_step_end(done: int) -> None:
        if done == step:
            if dist.is_initialized():
                dist.barrier()  # rank 0's checkpoint is complete before anyone dies
            os.kill(os.getpid(), sig)

    return on_step_end


def parse(spec: str) -> StepCallback:
    step, _, name = spec.partition(":")
    return kill_at(int(step), getattr(signal, name or "SIGKILL"))


if __name__ == "__main__":
    configure_logging(sys.stderr)
    terminate_on_sigterm()
    with open(sys.argv[1]) as fh:
        run_from_json(json.load(fh), parse(sys.argv[2]))
