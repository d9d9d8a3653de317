"""Checkpoints, kill-and-resume, stale-checkpoint refusal and torchrun data parallel, on CPU
with a tiny verifier built from a config and synthetic hidden-state shards."""

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from devkit.configs import build_draft
from devkit.train_inputs import make_train_inputs
from eagleflow.common.atomic import read_jsonl
from eagleflow.runtime.ledger import read_loads
from eagleflow.train.checkpoint import (
    TrainState,
    checkpoints,
    latest_checkpoint,
    load_checkpoint,
    restore,
    save_checkpoint,
    trainable_state,
)
from eagleflow.train.config import TrainConfig
from eagleflow.train.data import collate, load_shards, pack
from eagleflow.train.device import Runtime
from eagleflow.train.evaluation import Walk, evaluate
from eagleflow.train.launch import run_stage
from eagleflow.train.loop import run_from_json
from eagleflow.train.methods import draft_method
from eagleflow.train.optimizer import build_optimizer
from eagleflow.train.steps import lr_at
from tests.helpers import (
    MAX_STEPPED,
    REPO,
    TINY_EVAL_LENGTHS,
    TINY_TRAIN_CFG,
    TINY_TRAIN_LENGTHS,
    storage_steps,
)

TRAIN_LENGTHS, EVAL_LENGTHS, CFG = TINY_TRAIN_LENGTHS, TINY_EVAL_LENGTHS, TINY_TRAIN_CFG
NONDETERMINISTIC = {"tokens_per_s"}


@pytest.fixture(scope="module")
def inputs(tiny_llama_dir, tmp_path_factory):
    return make_train_inputs(
        tmp_path_factory.mktemp("train-inputs"), tiny_llama_dir, TRAIN_LENGTHS, EVAL_LENGTHS, draft_vocab=64
    )


# Online mode: the states the tiny verifier computes (hidden_states settings the rule passes).
ONLINE = {
    "aux_layer_ids": None,
    "dtype": "bfloat16",
    "compute_dtype": "auto",
    "batch_tokens": 64,
    "trust_remote_code": False,
}


def spec(tmp: Path, inputs, verifier, mode: str = "offline", **cfg) -> dict:
    online = mode == "online"
    return {
        "shards": [] if online else inputs["shards"],
        "index": None if online else inputs["index"],
        "dataset": inputs["dataset"] if online else [],
        "online": ONLINE if online else None,
        "log_path": str(tmp / "logs" / "train.default.log"),
        "vocab_map": inputs["vocab_map"],
        "verifier_dir": str(verifier),
        "draft_out": str(tmp / "draft"),
        "metrics_out": str(tmp / "train" / "metrics.jsonl"),
        "checkpoint_dir": str(tmp / "train" / "checkpoints"),
        "serve_verifier_path": str(verifier),
        "cfg": {**CFG, **cfg},
        "threads": 1,
    }


def run_subprocess(s: dict, tmp: Path, kill_at: str | None = None) -> subprocess.CompletedProcess:
    """`python -m eagleflow.train SPEC.json`, as one torchrun rank runs it; with
    `kill_at` ("STEP[:SIGNAME]"), a process that kills itself once that step is done."""
    path = tmp / f"spec-{os.urandom(4).hex()}.json"
    path.write_text(json.dumps(s))
    env = os.environ | {"PYTHONPATH": str(REPO)}
    module = ["tests.train_faults", str(path), kill_at] if kill_at else ["eagleflow.train", str(path)]
    return subprocess.run(
        [sys.executable, "-m", *module],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def strip(rows):
    return [{k: v for k, v in r.items() if k not in NONDETERMINISTIC} for r in rows]


def assert_rows_equal(got, want):
    assert [(r["step"], r["split"]) for r in got] == [(r["step"], r["split"]) for r in want]
    for g, w in zip(strip(got), strip(want), strict=True):
        assert g.keys() == w.keys()
        for k in g:
            if isinstance(g[k], float):
                assert math.isclose(g[k], w[k], rel_tol=1e-6, abs_tol=1e-9), (g["step"], g["split"], k, g[k], w[k])
            else:
                assert g[k] == w[k], (g["step"], k)


def assert_drafts_equal(a: Path, b: Path):
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


@pytest.fixture(scope="module")
def uninterrupted(inputs, tiny_llama_dir, tmp_path_factory):
    """mode -> (directory, metrics rows) of a run that was never killed."""
    runs = {}
    for mode in ("offline", "online"):
        tmp = tmp_path_factory.mktemp(f"uninterrupted-{mode}")
        s = spec(tmp, inputs, tiny_llama_dir, mode)
        run_from_json(s)
        runs[mode] = tmp, read_jsonl(s["metrics_out"])
    return runs


# --- checkpoint round trip -------------------------------------------------------------------


def small_model(inputs, verifier, seed):
    torch.manual_seed(seed)
    vocab = load_file(inputs["vocab_map"])
    model = build_draft(
        str(verifier), vocab["d2t"], vocab["t2d"], num_layers=1, ttt_steps=3, aux_layer_ids=[2, 4, 5], attn_impl="sdpa"
    )
    params = [p for p in model.parameters() if p.requires_grad]
    return model, params, torch.optim.AdamW(params, lr=0.01, betas=(0.9, 0.95))


def test_checkpoint_round_trip_restores_every_state(inputs, tiny_llama_dir, tmp_path):
    from speculators.losses import resolve_loss_config

    train, _, _ = load_shards(inputs["shards"])
    model, params, opt = small_model(inputs, tiny_llama_dir, seed=0)
    kwargs = {"ttt_steps": 3, "ttt_step_loss_decay": 1.0, "loss_config": resolve_loss_config("kl_div", "eager")}
    for batch in pack(train, 64, shuffle_seed=0)[:2]:
        _, loss, _ = model(**collate([train[i] for i in batch], 64), **kwargs)
        loss.backward()
        opt.step()
        opt.zero_grad()
    torch.manual_seed(1234)
    state = TrainState(
        step=2,
        epoch=0,
        batch_index=2,
        best_loss=0.5,
        best_step=1,
        rows=[{"step": 1, "split": "eval", "loss": 0.5}],
        window={"loss_sum": 1.25, "tokens": 40},
    )
    best = {k: v.clone() * 2 for k, v in trainable_state(model).items()}
    ckdir = tmp_path / "fp"
    for step in (2, 3, 4):  # keep=2 keeps the newest two
        state.step = step
        save_checkpoint(ckdir, "fp", model, opt, state, best, keep=2)
    assert [p.name for p in checkpoints(ckdir)] == ["step-00000003", "step-00000004"]
    assert not [p for p in ckdir.iterdir() if p.name.startswith(".")], "no temporaries left behind"
    expected_rng = torch.get_rng_state()

    fresh, _, fresh_opt = small_model(inputs, tiny_llama_dir, seed=99)
    torch.manual_seed(0)
    ckpt = latest_checkpoint(ckdir, "fp")
    restore(ckpt, fresh, fresh_opt)
    assert ckpt.state == state
    assert torch.equal(torch.get_rng_state(), expected_rng)
    for (name, a), b in zip(trainable_state(model).items(), trainable_state(fresh).values(), strict=True):
        assert torch.equal(a, b), name
    assert ckpt.best.keys() == best.keys() and all(torch.equal(ckpt.best[k], best[k]) for k in best)
    sa, sb = opt.state_dict(), fresh_opt.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for i in sa["state"]:
        for k in sa["state"][i]:
            assert torch.equal(sa["state"][i][k], sb["state"][i][k]), (i, k)
    with pytest.raises(ValueError, match="belongs to another config"):
        load_checkpoint(ckpt.path, "other")


# --- kill and resume -------------------------------------------------------------------------


@pytest.mark.parametrize(("mode", "signame"), [("offline", "SIGKILL"), ("offline", "SIGTERM"), ("online", "SIGKILL")])
def test_killed_run_resumes_and_matches_uninterrupted(inputs, tiny_llama_dir, uninterrupted, tmp_path, mode, signame):
    ref_dir, ref_rows = uninterrupted[mode]
    s = spec(tmp_path, inputs, tiny_llama_dir, mode)
    # Killed at step 6: the newest checkpoint is step 4, so steps 5-6 are trained twice.
    killed = run_subprocess(s, tmp_path, kill_at=f"6:{signame}")
    assert killed.returncode == (-signal.SIGKILL if signame == "SIGKILL" else 128 + signal.SIGTERM), killed.stderr[
        -3000:
    ]
    assert not Path(s["metrics_out"]).exists() and not Path(s["draft_out"]).exists()
    (fp_dir,) = Path(s["checkpoint_dir"]).iterdir()
    assert [p.name for p in checkpoints(fp_dir)] == ["step-00000004"]

    resumed = run_subprocess(s, tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    total = max(r["step"] for r in ref_rows)
    assert f"resuming from step 4 of {total}" in resumed.stderr
    rows = read_jsonl(s["metrics_out"])
    assert max(r["step"] for r in rows) == total
    assert_rows_equal(rows, ref_rows)
    assert_drafts_equal(Path(s["draft_out"]), ref_dir / "draft")
    assert not fp_dir.exists(), "a finished run removes its spent checkpoints"


def test_online_training_loads_the_verifier_once_and_learns_from_its_states(uninterrupted):
    offline_dir, offline_rows = uninterrupted["offline"]
    online_dir, online_rows = uninterrupted["online"]
    (load,) = read_loads(online_dir / "logs" / "servers")
    assert load["stage"] == "train" and load["kind"] == "start"
    assert not read_loads(offline_dir / "logs" / "servers")
    # Same tokens, same schedule; the verifier's states instead of the shards' random numbers.
    assert [(r["step"], r["split"]) for r in online_rows] == [(r["step"], r["split"]) for r in offline_rows]
    assert online_rows[-1]["loss"] != offline_rows[-1]["loss"]

    # Learns from its states: on held-out samples the draft ends far closer to the verifier than
    # at its first evaluation (here 0.140 -> 0.109), and gains more than the same run on the
    # shards' random states, where only the tokens teach it (0.143 -> 0.134).
    def eval_drop(rows):
        evals = [r["loss"] for r in rows if r["split"] == "eval"]
        return 1 - evals[-1] / evals[0]

    assert eval_drop(online_rows) >= 0.15
    assert eval_drop(online_rows) >= 2 * eval_drop(offline_rows)


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_online_states_are_those_the_offline_stage_stores(inputs, tiny_llama_dir, tmp_path, dtype):
    from eagleflow.common.config import typed
    from eagleflow.hidden_states.forward import extract, load_verifier
    from eagleflow.hidden_states.shard_file import ShardMeta, write_shard
    from eagleflow.train.online import OnlineStates, VerifierStates, load_token_samples

    tokens, _ = load_token_samples(*inputs["dataset"], train_fraction=1.0)
    online = VerifierStates(
        str(tiny_llama_dir), typed(OnlineStates, {**ONLINE, "dtype": dtype}, "hidden_states"), torch.device("cpu")
    )
    # Offline: one shard of every training sample, in the backend's own token-budget batches.
    samples = [{"id": t.id, "split": "train", "input_ids": t.input_ids, "loss_mask": t.loss_mask} for t in tokens]
    stored = extract(
        load_verifier(str(tiny_llama_dir), "cpu", torch.float32),
        samples,
        online.aux_layer_ids,
        4096,
        torch.bfloat16,
        progress=False,
    )
    shard = tmp_path / "shard.safetensors"
    hidden_size = stored[0][1].shape[1]
    write_shard(shard, samples, stored, ShardMeta([t.id for t in tokens], online.aux_layer_ids, 0, hidden_size), dtype)
    want, _, _ = load_shards([str(shard)])
    # Online: per training batch, batches of other shapes.
    got = online.samples(tokens[:5]) + online.samples(tokens[5:])
    # What both paths guarantee: the same float32 states, up to the summation order that other
    # batch shapes give matrix products on a CPU (its kernels decide where a sum is rounded).
    online_f32 = [
        extract(online.model, samples[:5], online.aux_layer_ids, 64, torch.float32, progress=False),
        extract(online.model, samples[5:], online.aux_layer_ids, 64, torch.float32, progress=False),
    ]
    offline_f32 = extract(online.model, samples, online.aux_layer_ids, 4096, torch.float32, progress=False)
    for (a_aux, a_final), (b_aux, b_final) in zip(online_f32[0] + online_f32[1], offline_f32, strict=True):
        torch.testing.assert_close(a_aux, b_aux, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(a_final, b_final, rtol=1e-4, atol=1e-5)
    # Rounded to the storage dtype, a value that close to a rounding boundary may land on the
    # neighbouring value: one step of the storage dtype, on few values, never more.
    steps = torch.cat(
        [
            storage_steps(getattr(g, field), getattr(w, field), dtype, num_states)
            for g, w in zip(got, want, strict=True)
            for field, num_states in (("hidden_states", len(online.aux_layer_ids)), ("verifier_last_hidden_states", 1))
        ]
    )
    for g, w in zip(got, want, strict=True):
        assert g.input_ids.equal(w.input_ids) and g.loss_mask.equal(w.loss_mask)
    assert steps.max() <= 1, f"{int((steps > 1).sum())} of {steps.numel()} values more than one step apart"
    assert (steps > 0).float().mean() <= MAX_STEPPED[dtype], f"{int((steps > 0).sum())} of {steps.numel()} stepped"


def test_changed_config_does_not_resume_stale_checkpoint(inputs, tiny_llama_dir, tmp_path):
    s = spec(tmp_path, inputs, tiny_llama_dir)
    assert run_subprocess(s, tmp_path, kill_at="6").returncode == -signal.SIGKILL
    (stale,) = Path(s["checkpoint_dir"]).iterdir()
    changed = {**s, "cfg": {**s["cfg"], "lr": 0.001}}
    done = run_subprocess(changed, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming from step" not in done.stderr
    assert "starting at step 0 of" in done.stderr
    assert (
        f"not resuming checkpoints of other configs/inputs/code in {s['checkpoint_dir']}: {stale.name}" in done.stderr
    )
    rows = read_jsonl(s["metrics_out"])
    assert rows[0]["step"] == 2 and rows[0]["lr"] == lr_at(1, max(r["step"] for r in rows), 0.001, CFG["warmup_steps"])
    assert stale.exists(), "another config's checkpoints are left alone"


# --- data parallel ---------------------------------------------------------------------------


@pytest.mark.parametrize("lengths", [[40, 36], [40, 36, 38]], ids=["even", "uneven"])
def test_torchrun_two_processes_equal_one_process_accumulating_each_steps_batches(tiny_llama_dir, tmp_path, lengths):
    """Two ranks, one epoch, a batch per sample. Even: one optimizer step of two batches.
    Uneven: a second step with one batch, where rank 1 stands in with a batch whose loss
    counts nothing. The result (DDP's averaged gradients) must equal one process accumulating
    the gradients of each step's batches (each loss scaled by 1 / its step's batches). A
    missing gradient all-reduce leaves rank 0 with its own batches' steps; the test checks
    that this counterfactual would be told apart."""
    from speculators.losses import resolve_loss_config

    torch.set_num_threads(1)  # as each rank: the same reduction order, bit-equal results
    inputs = make_train_inputs(tmp_path / "in", tiny_llama_dir, lengths, [30, 35, 25], draft_vocab=64, seed=1)
    s = spec(
        tmp_path, inputs, tiny_llama_dir, epochs=1, nproc_per_node=2, eval_every=0, log_every=1, warmup_steps=0, lr=0.01
    )
    run_stage(s, nproc=2)  # what the rule runs: torchrun, 2 gloo processes
    rows = read_jsonl(s["metrics_out"])
    train_rows, eval_row = [r for r in rows if r["split"] == "train"], [r for r in rows if r["split"] == "eval"]

    train, evals, aux = load_shards(inputs["shards"])
    batches = pack(train, 64, shuffle_seed=0)
    assert len(batches) == len(lengths)
    steps = [batches[i : i + 2] for i in range(0, len(batches), 2)]
    assert [r["step"] for r in train_rows] == list(range(1, len(steps) + 1)) and [r["step"] for r in eval_row] == [
        len(steps)
    ]
    cpu = Runtime(0, 1, torch.device("cpu"), "doc_sdpa", "eager")  # what the stage resolves auto to on CPU
    kwargs = {"ttt_steps": 3, "ttt_step_loss_decay": 1.0, "loss_config": resolve_loss_config("kl_div", "eager")}
    eagle3, cfg = draft_method("eagle3"), TrainConfig(**CFG)
    keys = eagle3.metric_keys(cfg)

    def accumulated(use_steps):
        torch.manual_seed(0)
        vocab = load_file(inputs["vocab_map"])
        model = build_draft(
            str(tiny_llama_dir),
            vocab["d2t"],
            vocab["t2d"],
            num_layers=1,
            ttt_steps=3,
            aux_layer_ids=aux,
            attn_impl="doc_sdpa",
        )
        params = [p for p in model.parameters() if p.requires_grad]
        opt = build_optimizer(model, CFG["optimizer"], lr=0.01, weight_decay=0.0)
        losses = []
        for n, step in enumerate(use_steps):
            for group in opt.param_groups:
                group["lr"] = lr_at(n, len(use_steps), 0.01, 0)
            losses.append([])
            for b in step:
                _, loss, _ = model(**collate([train[i] for i in b], 64), **kwargs)
                (loss / len(step)).backward()
                losses[-1].append(float(loss.detach()))
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        summarise = lambda totals: eagle3.summarise(totals, cfg)  # noqa: E731
        return model, losses, evaluate(model, evals, 64, kwargs, cpu, keys, summarise, walk=Walk.of(eagle3, cfg))

    model, losses, ref_eval = accumulated(steps)
    for row, step_losses in zip(train_rows, losses, strict=True):
        assert math.isclose(row["loss"], sum(step_losses) / len(step_losses), rel_tol=1e-5)
    for k, v in ref_eval.items():
        assert math.isclose(eval_row[0][k], v, rel_tol=1e-5, abs_tol=1e-7), k
    _, _, rank0_only = accumulated([step[:1] for step in steps])
    assert not math.isclose(rank0_only["loss"], ref_eval["loss"], rel_tol=1e-4), (
        "the test cannot tell a missing all-reduce apart"
    )

    draft = load_file(str(Path(s["draft_out"]) / "model.safetensors"))
    for name, value in trainable_state(model).items():
        assert torch.equal(draft[name], value.to(torch.bfloat16)), name


def test_failed_torchrun_raises_with_its_exit_status(tiny_llama_dir, inputs, tmp_path):
    s = spec(tmp_path, inputs, tiny_llama_dir, nproc_per_node=2)
    s["index"] = str(tmp_path / "missing.json")
    with pytest.raises(RuntimeError, match="torchrun with 2 training processes exited with 1"):
        run_stage(s, nproc=2)
    assert not Path(s["draft_out"]).exists()


@pytest.mark.parametrize("window", [None, 16])
def test_exported_draft_attention_follows_sliding_window(inputs, tiny_llama_dir, tmp_path, window):
    from eagleflow.train.draft import export_draft

    vocab = load_file(inputs["vocab_map"])
    model = build_draft(
        str(tiny_llama_dir),
        vocab["d2t"],
        vocab["t2d"],
        num_layers=2,
        ttt_steps=3,
        aux_layer_ids=[2, 4, 5],
        attn_impl="sdpa",
        sliding_window=window,
    )
    assert model.uses_sliding_window_attn == (window is not None) and model.uses_full_attn == (window is None)
    export_draft(model, model.state_dict(), tmp_path / "draft", str(tiny_llama_dir))
    layer = json.loads((tmp_path / "draft" / "config.json").read_text())["transformer_layer_config"]
    assert layer["sliding_window"] == window
    assert layer["layer_types"] == ["sliding_attention" if window else "full_attention"] * 2
