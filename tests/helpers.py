"""What only the tests share: the repository's paths, the SLURM test cluster's start, reads of
a response store, the running vLLM processes, and the comparisons of stored states. The
builders the benchmarks use too (configs, tiny verifiers, workflow copies, the fake OpenAI
server, training inputs) are in devkit/."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

REPO = Path(__file__).resolve().parents[1]
SNAKEMAKE = [sys.executable, "-m", "snakemake"]


START_CLUSTER = REPO / "tests/slurm/start_cluster.sh"


START_CLUSTER_STDERR = Path("/run/eagleflow-slurm-start.stderr")


def run_start_cluster() -> subprocess.CompletedProcess:
    """tests/slurm/start_cluster.sh, one call at a time across test workers (`make test` runs
    two). The lock is taken here, not in the script: the daemons it starts would inherit the
    script's lock and hold it for as long as they run."""
    import fcntl

    with open("/run/eagleflow-slurm-start.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        proc = subprocess.run([str(START_CLUSTER)], capture_output=True, text=True, timeout=900)
    # What the script said, for a test that finds the cluster other than it expects.
    START_CLUSTER_STDERR.write_text(proc.stderr)
    return proc


def stored_replies(store: Path) -> int:
    """Replies committed to a response store, read as a second process would (WAL: readers
    see every commit)."""
    if not store.exists():
        return 0
    with sqlite3.connect(store, timeout=10) as db:
        try:
            return db.execute("SELECT COUNT(*) FROM replies").fetchone()[0]
        except sqlite3.OperationalError:
            return 0


def vllm_available() -> bool:
    """Whether vLLM imports here: the tests that need it skip where it does not. Where the
    environment says it must (EAGLEFLOW_TESTS_NEED_VLLM=1, as .ci/run sets), a vLLM that does
    not import is an error instead: CI must not pass by skipping the pipeline."""
    try:
        import vllm  # noqa: F401
    except Exception as exc:
        if os.environ.get("EAGLEFLOW_TESTS_NEED_VLLM") == "1":
            raise RuntimeError(f"EAGLEFLOW_TESTS_NEED_VLLM=1 and vLLM does not import: {exc!r}") from exc
        return False
    return True


def vllm_processes(marker: str) -> list[str]:
    """Command lines of running vLLM processes that mention `marker` (e.g. a workflow copy's path)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "vllm" in cmd and marker in cmd:
            found.append(cmd)
    return found


# The train section and sample lengths of the tests that train a draft on the tiny verifier's
# synthetic shards (devkit.train_inputs).
TINY_TRAIN_LENGTHS = [30, 25, 40, 20, 35, 28, 33, 22, 38, 26, 31, 24]
TINY_EVAL_LENGTHS = [30, 35, 25]
TINY_TRAIN_CFG = dict(
    method="eagle3",
    num_layers=1,
    ttt_steps=3,
    num_depths=3,
    block_size=4,
    ttt_step_loss_decay=1.0,
    loss="kl_div",
    loss_implementation="auto",
    attn_impl="auto",
    sliding_window=None,
    draft_attention="llama",
    optimizer="muon",  # the default; its two inner optimizers' states go through every checkpoint
    lr=0.002,
    lr_schedule="linear",
    weight_decay=0.0,
    warmup_steps=2,
    grad_clip=1.0,
    epochs=2,
    batch_tokens=64,
    log_every=2,
    eval_every=3,
    checkpoint_every=4,
    keep_checkpoints=2,
    nproc_per_node=1,
    seed=0,
    gpus=0,
    sample_fraction=1.0,
    norm_before_fc=False,
    norm_output=False,
)


# The share of stored values the two paths may round to neighbouring values. bfloat16: a float32
# difference of ~1e-6 relative puts a value on the other side of a bf16 rounding boundary (steps
# 2**-8 relative) a few times in ten thousand at most. fp8 rounds those bf16 values again, to
# steps 2**5 times as wide, so only a few percent of the values bf16 moved move in fp8. Measured
# on an AVX-512 CPU without AMX: 9 (bf16) and 2 (fp8) of 174,080 values one step apart.
MAX_STEPPED = {"bfloat16": 0.01, "float8_e4m3fn": 0.001}


def storage_steps(a: torch.Tensor, b: torch.Tensor, dtype: str, num_states: int) -> torch.Tensor:
    """How many steps of storage dtype `dtype` apart each value of `a` and `b` (states as
    training reads them back, [tokens, num_states * hidden]) is. fp8 values are e4m3 codes times
    a per-token, per-state scale, which each tensor's own amax gives back (the amax is stored as
    448 exactly); codes are compared as signed magnitudes, whose e4m3 bit patterns are ordered."""
    import torch

    from eagleflow.hidden_states.storage import FP8, quantize_fp8

    if dtype != FP8:
        return (ordinal(a.to(torch.bfloat16), 0x7FFF) - ordinal(b.to(torch.bfloat16), 0x7FFF)).abs().flatten()
    codes = [quantize_fp8(t, num_states)[0] for t in (a, b)]
    return (ordinal(codes[0], 0x7F) - ordinal(codes[1], 0x7F)).abs().flatten()


def ordinal(t: torch.Tensor, magnitude_bits: int) -> torch.Tensor:
    """Sign-magnitude bit patterns (bfloat16, e4m3) as integers ordered like the values they hold."""
    import torch

    bits = t.view(torch.int16 if t.element_size() == 2 else torch.uint8).to(torch.int32)
    magnitude = bits & magnitude_bits
    return torch.where(bits & (magnitude_bits + 1) != 0, -magnitude, magnitude)


def stored_beside_transformers(index, verifier_dir, store_dtype: torch.dtype):
    """[(sample, transformers' (aux, final))] for every sample `index` (an index.json or a
    part's manifest) names: the verifier's float32 forward in transformers (the hf backend's
    hooks) on the sample's own tokens, handed over in `store_dtype`."""
    import json
    from pathlib import Path

    import torch

    from eagleflow.hidden_states.forward import extract, load_verifier
    from eagleflow.hidden_states.shard_reader import read_indexed

    verifier = load_verifier(str(verifier_dir), "cpu", torch.float32)
    samples = read_indexed(index)
    expected = extract(
        verifier,
        [{"id": s.id, "input_ids": s.input_ids.tolist()} for s in samples],
        json.loads(Path(index).read_text())["aux_layer_ids"],
        batch_tokens=1 << 16,
        store_dtype=store_dtype,
        progress=False,
    )
    return list(zip(samples, expected, strict=True))


# A draft of tests' tiny Llama verifier (tiny_llama_dir: vocab 128, hidden 128), on every other
# token of its vocabulary, with random packed samples to train it on.
TINY_VOCAB, TINY_HIDDEN, TINY_AUX = 128, 128, [2, 4, 5]


def tiny_draft(verifier_dir, attn_impl: str = "sdpa", ttt_steps: int = 3, sliding_window=None):
    import torch

    from devkit.configs import build_draft

    t2d = torch.zeros(TINY_VOCAB, dtype=torch.bool)
    t2d[::2] = True
    d2t = torch.nonzero(t2d).flatten() - torch.arange(int(t2d.sum()))
    torch.manual_seed(0)
    return build_draft(
        str(verifier_dir),
        d2t,
        t2d,
        num_layers=1,
        ttt_steps=ttt_steps,
        aux_layer_ids=TINY_AUX,
        attn_impl=attn_impl,
        sliding_window=sliding_window,
    )


def random_samples(lengths: list[int], seed: int) -> list:
    """Training samples of these lengths for tiny_draft: random tokens, states and loss mask."""
    import torch

    from eagleflow.train.data import Sample

    g = torch.Generator().manual_seed(seed)
    return [
        Sample(
            torch.randint(0, TINY_VOCAB, (n,), generator=g),
            torch.randn(n, len(TINY_AUX) * TINY_HIDDEN, generator=g),
            torch.randn(n, TINY_HIDDEN, generator=g),
            torch.rand(n, generator=g) > 0.3,
        )
        for n in lengths
    ]


# What only moves or converts a tensor: storing states in bfloat16 is a conversion, not arithmetic.
DATA_MOVEMENT_OPS = {
    "_to_copy",
    "copy_",
    "clone",
    "detach",
    "alias",
    "lift_fresh",
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "zeros_like",
    "contiguous",
    "cat",
    "stack",
    "index",
    "index_select",
    "split_with_sizes",
    "unbind",
}


def low_precision_ops():
    """A dispatch mode that records every aten operator that computes on a bfloat16 or float16
    tensor (operators that only view, move or convert one excepted): `with low_precision_ops()
    as seen: ...`, then `seen.ops` names them. What a CPU would run on a reference path without
    bf16 units, whatever the machine the test runs on."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    low = (torch.bfloat16, torch.float16)

    class LowPrecisionOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            moves = func.is_view or name in DATA_MOVEMENT_OPS
            if not moves and any(isinstance(t, torch.Tensor) and t.dtype in low for t in tree_leaves((args, kwargs))):
                self.ops.add(name)
            return func(*args, **(kwargs or {}))

    return LowPrecisionOps()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b| over the whole tensors, in float32."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def write_dataset(tmp_path: Path, n: int = 7, n_train: int = 5) -> list[dict]:
    """A dataset stage's output of `n` short samples (`n_train` train, the rest eval) under
    `tmp_path`, for the hidden-state phase's tests; the rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {
            "id": f"s{i}",
            "input_ids": list(range(1, 4 + i)),
            "loss_mask": [0] * 2 + [1] * (1 + i),
            "length": 3 + i,
            "num_loss_tokens": 1 + i,
        }
        for i in range(n)
    ]
    pq.write_table(pa.Table.from_pylist(rows[:n_train]), tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows[n_train:]), tmp_path / "eval.parquet")
    return rows


# The hf hidden-state backend on the CPU, as write_dataset's tests run it.
HF_SETTINGS = {"backend": "hf", "batch_tokens": 32, "dtype": "bfloat16", "device": "cpu", "compute_dtype": "auto"}


def run_bench(script: str, *args, cwd: Path = REPO, timeout: float = 600, env: dict | None = None) -> str:
    """`python bench/<script> ARGS` as its docstring runs it (from the repository unless `cwd`
    says); its stdout, or a failure that names the script and shows its stderr."""
    cmd = [sys.executable, str(REPO / "bench" / script), *map(str, args)]
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, f"bench/{script} exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    return proc.stdout
