"""One short GPU check (for a session lent an H200): training and extraction at real sizes.

    python bench/gpu_check.py --out "$OUT/gpu_check.json"        # on the GPU host, ~3-5 min
    python bench/gpu_check.py --tiny --out /tmp/gpu_check.json    # the same code on CPU, small

1. Training: an EAGLE-3 draft sized for an 8B-class verifier (Llama-3.1-8B geometry: hidden
   4096, 32 heads / 8 KV heads, vocab 128256; draft vocab 32000, 1 layer, 3 TTT steps) on
   random hidden states, through the project's own `train_step` (bf16 autocast, and "auto"
   attention/loss, which on CUDA + Triton are flex attention and the fused loss). Reports
   tokens/s and peak GPU memory per batch size. Then the production config's draft: Kimi-K2.5's
   geometry (config/verifiers/kimi-k2.5.json, MLA, vocab 163840) with each draft layer eagleflow
   trains for it (`llama`, `mla`), at its 16K-token steps and 32K. `--tiny` trains a small MLA
   draft too.
2. Extraction: a randomly initialised 1B-class Llama verifier (hidden 2048, 16 layers,
   vocab 128256) in bf16; tokens/s of the hf backend's capture path (`hidden_states.extract`)
   against a plain forward of the same batches (capture overhead as a ratio).
3. The two hidden-state backends as the part job runs them (`hidden_states.run.run_part`):
   the same 1B-class verifier (with a character tokenizer, so vLLM can serve it) saved to disk,
   one part of random-token samples through the `hf` backend and through the `vllm` backend
   (vLLM's extract_hidden_states with eagleflow's connector); wall time, start-up, tokens/s and
   the states' relative L2 distance. `--no-vllm` leaves it out (CI runs the rest in --tiny).
4. With `--peer-workdir DIR` (a copy of the workflow with a finished run, e.g. the demo's): the
   peer's draft, speculators' own `speculators train` with its defaults on that run's data
   (bench/peer_draft.py; on a CPU it runs through bench/speculators_on_cpu.py), then both drafts on the standard sets
   (bench/standard_sets.py --draft speculators default, one baseline), their reports under `peer`.

Only the embedding, lm_head and final-norm tensors of the verifiers are written (the draft reads
nothing else); nothing is downloaded. Each check runs on when another fails (`failed` in the
report, exit status 1), and the report is rewritten after each, so a run cut short keeps what
it measured; `--only` picks checks and their order, `--batch-tokens` the training step sizes.
Results go to --out as JSON and to stdout.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import logging
import platform
import random
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import yaml
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "workflow"))  # the eagleflow package, installed or not
sys.path.insert(0, str(REPO / "bench"))

from hidden_states_overhead import plain  # noqa: E402 (a sibling bench script)

from devkit.configs import build_draft  # noqa: E402
from eagleflow.common.atomic import write_json  # noqa: E402
from eagleflow.common.config import typed  # noqa: E402
from eagleflow.hidden_states.forward import extract  # noqa: E402
from eagleflow.hidden_states.layers import default_aux_layer_ids  # noqa: E402
from eagleflow.train.config import TrainConfig  # noqa: E402
from eagleflow.train.data import Sample, collate, pack  # noqa: E402
from eagleflow.train.device import init_runtime  # noqa: E402
from eagleflow.train.methods import draft_method  # noqa: E402
from eagleflow.train.optimizer import build_optimizer  # noqa: E402
from eagleflow.train.steps import pad_to_length, train_step  # noqa: E402

LLAMA_8B = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "rope_theta": 500000.0,
}
LLAMA_1B = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 128256,
    "rope_theta": 500000.0,
}
TINY = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 4096,
    "rope_theta": 10000.0,
}


def llama_config(geometry: dict, **extra):
    from transformers import LlamaConfig

    g = dict(geometry)
    theta = g.pop("rope_theta")
    return LlamaConfig(
        **g,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
        **extra,
    )


def embeddings_only_verifier(out: Path, config) -> Path:
    """config.json plus the tensors a draft takes from its verifier (embeddings, lm_head,
    final norm), random, bf16 (drawn on the GPU where there is one: Kimi's are 2.3 GB each)."""
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    shape = (config.vocab_size, config.hidden_size)
    device = "cuda" if torch.cuda.is_available() else "cpu"

    def rand(*size):
        return torch.randn(size, dtype=torch.bfloat16, device=device).cpu()

    save_file(
        {
            "model.embed_tokens.weight": rand(*shape) * 0.02,
            "lm_head.weight": rand(*shape) * 0.02,
            "model.norm.weight": 1 + 0.1 * rand(config.hidden_size),
        },
        str(out / "model.safetensors"),
    )
    return out


def llama_verifier(out: Path, geometry: dict) -> Path:
    config = llama_config(geometry)
    config.architectures = ["LlamaForCausalLM"]
    return embeddings_only_verifier(out, config)


def mla_verifier(out: Path, text_config: dict) -> Path:
    """A DeepSeek-V3 (MLA) verifier of `text_config`'s geometry, as transformers knows it: the
    draft reads the geometry by name, so Kimi-K2.5's own (custom-code) config builds the same draft."""
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(**{k: v for k, v in text_config.items() if k != "model_type"})
    config.architectures = ["DeepseekV3ForCausalLM"]
    return embeddings_only_verifier(out, config)


def draft_vocab(vocab_size: int, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    chosen = torch.sort(torch.randperm(vocab_size)[:draft_vocab_size]).values
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[chosen] = True
    return chosen - torch.arange(draft_vocab_size), t2d


def random_batches(
    count: int, batch_tokens: int, lengths: tuple[int, int], hidden: int, num_aux: int, vocab: int
) -> list[dict]:
    """`count` packed batches of random samples, float32 on the host as the loop loads shards."""
    rng = random.Random(0)
    samples = []
    while sum(map(len, samples)) < count * batch_tokens:
        t = rng.randint(*lengths)
        samples.append(
            Sample(
                torch.randint(vocab, (t,)),
                torch.randn(t, num_aux * hidden),
                torch.randn(t, hidden),
                torch.ones(t, dtype=torch.bool),
            )
        )
    return [collate([samples[i] for i in b], batch_tokens) for b in pack(samples, batch_tokens, shuffle_seed=0)][:count]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_training(
    verifier: Path, draft_vocab_size: int, batch_sizes: list[int], steps: int, attention: str = "llama"
) -> list[dict]:
    """The draft of `verifier` with `train.draft_attention: attention`, the workflow's train
    defaults otherwise; tokens/s and peak memory per batch size (tokens per step)."""
    from speculators.losses import resolve_loss_config

    from eagleflow.common.verifier_config import read_text_config

    section = yaml.safe_load((REPO / "config/config.yaml").read_text())["train"]
    cfg = typed(TrainConfig, section | {"attn_impl": "auto", "loss_implementation": "auto"}, "train")
    rt = init_runtime(cfg)
    started = time.perf_counter()
    geometry = read_text_config(str(verifier))
    d2t, t2d = draft_vocab(geometry["vocab_size"], draft_vocab_size)
    aux = default_aux_layer_ids(geometry["num_hidden_layers"])
    model = build_draft(
        str(verifier),
        d2t,
        t2d,
        num_layers=1,
        ttt_steps=cfg.ttt_steps,
        aux_layer_ids=aux,
        attn_impl=rt.attn_impl,
        sliding_window=None,
        attention=attention,
    ).to(rt.device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(model, cfg.optimizer, lr=1e-4, weight_decay=cfg.weight_decay)  # the default: Muon
    fwd = {
        "ttt_steps": cfg.ttt_steps,
        "ttt_step_loss_decay": cfg.ttt_step_loss_decay,
        "loss_config": resolve_loss_config(cfg.loss, rt.loss_implementation),
    }
    keys = draft_method("eagle3").metric_keys(cfg)
    rows = []
    print(
        f"training {verifier.name} ({attention} layer, built in {time.perf_counter() - started:.0f} s): "
        f"draft {sum(p.numel() for p in params) / 1e6:.0f}M "
        f"trainable params, attention {rt.attn_impl}, "
        f"loss {rt.loss_implementation}, device {rt.device}",
        flush=True,
    )
    for batch_tokens in batch_sizes:
        # Three distinct batches, cycled: the values do not matter for speed, host memory does.
        started = time.perf_counter()
        distinct = random_batches(
            3, batch_tokens, (256, 2048), geometry["hidden_size"], len(aux), geometry["vocab_size"]
        )
        # Padded as the training loop pads them (one shape, whole flex-attention blocks).
        distinct = [pad_to_length(b, rt.step_length(batch_tokens)) for b in distinct]
        batches = [distinct[i % len(distinct)] for i in range(steps + 2)]
        print(f"  {batch_tokens} tokens: batches made in {time.perf_counter() - started:.0f} s", flush=True)
        if rt.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(rt.device)
        try:
            started = time.perf_counter()
            for batch in batches[:2]:  # warm-up: kernels compile (flex attention), allocator settles
                train_step(model, params, optimizer, batch, rt, fwd, lr=1e-4, loss_scale=1.0, grad_clip=1.0, keys=keys)
            sync(rt.device)
            warmup_s = time.perf_counter() - started
            print(f"  warm-up (2 steps, compiling): {warmup_s:.0f} s", flush=True)
            start, tokens = time.perf_counter(), 0
            for batch in batches[2:]:
                _, metrics = train_step(
                    model, params, optimizer, batch, rt, fwd, lr=1e-4, loss_scale=1.0, grad_clip=1.0, keys=keys
                )
                tokens += int((batch["document_ids"] >= 0).sum())  # real tokens, not padding
            sync(rt.device)
            elapsed = time.perf_counter() - start
            row = {
                "batch_tokens": batch_tokens,
                "steps": len(batches) - 2,
                "tokens_per_s": tokens / elapsed,
                "s_per_step": elapsed / (len(batches) - 2),
                "finite_metrics": bool(torch.isfinite(metrics).all()),
                "warmup_s": warmup_s,
            }
        except torch.OutOfMemoryError as exc:
            row = {"batch_tokens": batch_tokens, "error": f"out of memory: {str(exc).splitlines()[0]}"}
            optimizer.zero_grad(set_to_none=True)
        if rt.device.type == "cuda":
            row["peak_memory_gib"] = torch.cuda.max_memory_allocated(rt.device) / 2**30
        rows.append(
            row
            | {
                "verifier": verifier.name,
                "draft_attention": attention,
                "trainable_params_m": sum(p.numel() for p in params) / 1e6,
                "attn_impl": rt.attn_impl,
                "loss_implementation": rt.loss_implementation,
            }
        )
        print(f"  {row}", flush=True)
    return rows


def check_extraction(geometry: dict, batch_tokens: int, num_samples: int, rounds: int, device: torch.device) -> dict:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = LlamaForCausalLM(llama_config(geometry, attn_implementation="sdpa")).to(dtype).eval()
    rng = random.Random(0)
    samples = [
        {
            "input_ids": [
                rng.randrange(geometry["vocab_size"])
                for _ in range(rng.randint(256, 4096 if device.type == "cuda" else 256))
            ]
        }
        for _ in range(num_samples)
    ]
    tokens = sum(len(s["input_ids"]) for s in samples)
    aux = default_aux_layer_ids(geometry["num_hidden_layers"])
    with torch.inference_mode():  # warm-up
        plain(model, samples[:2], batch_tokens)
        extract(model, samples[:2], aux, batch_tokens, torch.bfloat16)
    times = {"plain": 0.0, "capture": 0.0}
    for _ in range(rounds):  # A B B A: drift hits both
        for name in ("plain", "capture", "capture", "plain"):
            sync(device)
            t = time.perf_counter()
            with torch.inference_mode():
                if name == "plain":
                    plain(model, samples, batch_tokens)
                else:
                    extract(model, samples, aux, batch_tokens, torch.bfloat16)
            sync(device)
            times[name] += time.perf_counter() - t
    passes = 2 * rounds
    row = {
        "params_b": sum(p.numel() for p in model.parameters()) / 1e9,
        "tokens": tokens,
        "batch_tokens": batch_tokens,
        "plain_tokens_per_s": tokens * passes / times["plain"],
        "capture_tokens_per_s": tokens * passes / times["capture"],
        "capture_over_plain_time": times["capture"] / times["plain"],
    }
    print(f"extraction: {row}", flush=True)
    return row


def check_backends(geometry: dict, num_samples: int, max_len: int, tmp: Path, device: torch.device) -> dict:
    """One part through each hidden-state backend; the states compared."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import LlamaForCausalLM

    from devkit.configs import hidden_states_config, lean_server_config
    from devkit.verifiers import TINY_VOCAB, char_tokenizer
    from eagleflow.hidden_states.run import run_part
    from eagleflow.hidden_states.shard_reader import read_indexed

    cuda = device.type == "cuda"
    dtype = "bfloat16" if cuda else "float32"
    torch.manual_seed(0)
    verifier = tmp / "verifier"
    config = llama_config({**geometry, "vocab_size": TINY_VOCAB})
    config.architectures = ["LlamaForCausalLM"]
    LlamaForCausalLM(config).to(getattr(torch, dtype)).save_pretrained(verifier)
    char_tokenizer().save_pretrained(verifier)
    rng = random.Random(0)
    rows = []
    for i in range(num_samples):
        n = rng.randint(max_len // 4, max_len)
        ids = [rng.randrange(3, TINY_VOCAB) for _ in range(n)]
        rows.append({"id": f"s{i}", "input_ids": ids, "loss_mask": [1] * n, "length": n, "num_loss_tokens": n})
    pq.write_table(pa.Table.from_pylist(rows[: num_samples - 1]), tmp / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows[num_samples - 1 :]), tmp / "eval.parquet")
    tokens = sum(r["length"] for r in rows)
    server = lean_server_config(dtype=dtype, max_model_len=max_len + 8, startup_timeout_s=1800)
    if cuda:  # the GPU's own defaults: a worker process, vLLM's KV cache sizing
        server = lean_server_config(
            dtype=dtype, max_model_len=max_len + 8, startup_timeout_s=1800, extra_args=[], env={}, gpus=1
        )
    row: dict = {"tokens": tokens, "samples": num_samples, "dtype": dtype}
    parts = {}
    for backend in ("hf", "vllm"):
        settings = hidden_states_config(
            backend=backend,
            num_parts=1,
            dtype="float32",
            device="cuda" if cuda else "cpu",
            compute_dtype=dtype,
            linger_s=0,
            vllm={"storage_dir": str(tmp / "hs"), "concurrency": 16},
        )
        log = tmp / f"logs/{backend}/hidden_states.part-00000.log"
        parts[backend] = tmp / backend / "part-00000.json"  # its store beside it, one per backend
        log.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(log)  # what the stage's job log would hold
        logging.getLogger().addHandler(handler)
        logging.getLogger().setLevel(logging.INFO)
        started = time.perf_counter()
        run_part(
            str(tmp / "train.parquet"),
            str(tmp / "eval.parquet"),
            str(verifier),
            0,
            str(parts[backend]),
            settings=settings,
            server=server,
            threads=1 if cuda else 2,
            gpus=1 if cuda else 0,
            trust_remote_code=False,
            log_path=str(log),
        )
        wall = time.perf_counter() - started
        logging.getLogger().removeHandler(handler)
        handler.close()
        waited = [float(w) for w in re.findall(r"healthy after (\d+) s", log.read_text())]
        startup = waited[0] if waited else 0.0
        row[backend] = {
            "wall_s": wall,
            "startup_s": startup,
            "tokens_per_s_after_startup": tokens / max(wall - startup, 1e-9),
        }
    hf = read_indexed(parts["hf"])
    vl = read_indexed(parts["vllm"])
    for name in ("aux", "final"):
        got = torch.cat([getattr(s, name) for s in vl])
        want = torch.cat([getattr(s, name) for s in hf])
        row[f"{name}_rel_l2"] = ((got - want).norm() / want.norm()).item()
    print(f"backends: {row}", flush=True)
    return row


def check_peer(workdir: Path, out: Path) -> dict:
    """speculators' trainer on the run in `workdir` (bench/peer_draft.py), then its draft and
    the run's own on the standard sets; each step's exit status, wall time and report."""
    bench = Path(__file__).resolve().parent
    keep = out / "peer"
    steps = {
        "train": [str(bench / "peer_draft.py"), "--workdir", str(workdir)],
        # One baseline for both drafts, on the same sets.
        "measure": [str(bench / "standard_sets.py"), "--workdir", str(workdir)]
        + ["--draft", "speculators", "default", "--out", str(keep)],
    }
    result = {}
    for name, cmd in steps.items():
        started = time.perf_counter()
        proc = subprocess.run([sys.executable, *cmd], capture_output=True, text=True)
        result[name] = {"returncode": proc.returncode, "wall_s": time.perf_counter() - started}
        if proc.returncode != 0:
            result[name]["stderr_tail"] = proc.stderr[-3000:]
            return result
    for draft in ("speculators", "default"):
        result[draft] = {
            key: cell["speculative"]["mean_acceptance_length"]
            for key, cell in json.loads((keep / f"{draft}.json").read_text())["cells"].items()
        }
    return result


# Kimi-K2.5's language model as the production config serves it (config/kimi-k2.5-8xgpu.yaml).
KIMI_K25 = json.loads((REPO / "config/verifiers/kimi-k2.5.json").read_text())["text_config"]
TINY_MLA = {
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 64,
    "kv_lora_rank": 128,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 32,
    "v_head_dim": 32,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "rope_theta": 50000.0,
}


def sections(
    tiny: bool, steps: int, vllm: bool, tmp: Path, device: torch.device, batch_tokens: list[int] | None
) -> dict:
    """Each check by name, run in this order; a GPU host runs them at real sizes."""
    if tiny:
        return {
            "training": lambda: check_training(llama_verifier(tmp / "llama", TINY), 1024, [1024], 3),
            "training_mla": lambda: check_training(mla_verifier(tmp / "mla", TINY_MLA), 1024, [1024], 3, "mla"),
            "extraction": lambda: check_extraction(TINY, 1024, 4, 1, device),
            **({"backends": lambda: check_backends(TINY, 8, 256, tmp, device)} if vllm else {}),
        }
    # The production config's draft: Kimi-K2.5's geometry, draft vocabulary and step size,
    # with each draft layer eagleflow can train for it (llama, the default; mla).
    kimi = functools.cache(lambda: mla_verifier(tmp / "kimi-k2.5", KIMI_K25))
    return {
        "training": lambda: check_training(
            llama_verifier(tmp / "llama-8b", LLAMA_8B), 32000, batch_tokens or [8192, 16384, 32768], steps
        ),
        "training_kimi": lambda: check_training(kimi(), 32000, batch_tokens or [16384, 32768], steps),
        "training_kimi_mla": lambda: check_training(kimi(), 32000, batch_tokens or [16384, 32768], steps, "mla"),
        "extraction": lambda: check_extraction(LLAMA_1B, 32768, 48, 2, device),
        **({"backends": lambda: check_backends(LLAMA_1B, 256, 4096, tmp, device)} if vllm else {}),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true", help="small sizes, for a CPU smoke run of the same code")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--only", nargs="+", help="these checks alone, in this order (names as in the report)")
    ap.add_argument("--batch-tokens", type=int, nargs="+", help="the training checks' step sizes (tokens)")
    ap.add_argument("--no-vllm", action="store_true", help="leave out the backend comparison (it starts vLLM)")
    ap.add_argument(
        "--peer-workdir", type=Path, help="a finished run's workflow copy: train and measure the peer draft"
    )
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
        "triton": importlib.util.find_spec("triton") is not None,
        "tiny": args.tiny,
        "failed": [],
    }
    print(report, flush=True)
    with tempfile.TemporaryDirectory(prefix="eagleflow-gpu-check-") as tmp:
        # One failing check does not cost the others (a lent GPU's minutes are few); the
        # report is rewritten after each, so a run cut short still leaves what it measured.
        checks = sections(args.tiny, args.steps, not args.no_vllm, Path(tmp), device, args.batch_tokens)
        if unknown := set(args.only or []) - set(checks):
            sys.exit(f"--only: no check named {', '.join(sorted(unknown))} (there are {', '.join(checks)})")
        for name in args.only or list(checks):
            check = checks[name]
            started = time.perf_counter()
            try:
                report[name] = check()
            except Exception:
                report[name] = {"error": traceback.format_exc()[-4000:]}
                report["failed"].append(name)
                print(f"{name} FAILED:\n{report[name]['error']}", flush=True)
            report.setdefault("wall_s", {})[name] = round(time.perf_counter() - started, 1)
            if cuda:
                torch.cuda.empty_cache()
            write_json(out, report)
    if args.peer_workdir:
        report["peer"] = check_peer(args.peer_workdir.resolve(), out.resolve().parent)
    write_json(out, report)
    print(f"wrote {args.out}")
    if report["failed"]:
        sys.exit(f"failed: {', '.join(report['failed'])}")


if __name__ == "__main__":
    main()
