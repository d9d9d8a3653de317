"""The cheap stages at scale: generate's join, synth, dataset and vocab on N conversations,
each in its own process, its wall time and peak memory (the kernel's, os.wait4); beside
them a join that reads every shard whole (read, sort, write), the way a stage that does not
stream would, for the ratio.

    .venv/bin/python bench/cheap_stages_scale.py --conversations 10000 100000 600000 \
        [--shards 16] [--prompt-tokens 150] [--reply-tokens 400] [--workdir DIR]

The replies are made here, not asked of a server: `--shards` generate shards' replies.parquet
(conversations of one turn, every fourth of two; each row's request and reply body shaped as
vLLM's, its token ids and text included), each shard in the prompt file's order, as a
generate shard writes them. The stages then run on them as the DAG runs them (the default
config's synth, dataset and vocab settings; a 128K-token verifier vocabulary).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "workflow"))  # the eagleflow package, installed or not

from eagleflow.common.atomic import parquet_rows, write_json, write_jsonl  # noqa: E402
from eagleflow.generate.run import Shard  # noqa: E402

VOCAB = 128_000

STAGES = {
    "generate_join": """
from eagleflow.generate.join import join_shards
parts = [f"{w}/shards/{i}-of-{n}" for i in range(n)]
join_shards(f"{w}/prompts.jsonl", [p + "/replies.parquet" for p in parts], [p + "/stats.json" for p in parts],
            f"{w}/replies.parquet", f"{w}/generate_stats.json")
""",
    "synth": """
from eagleflow.common.config import typed
from eagleflow.synth.run import Parsing, run_synth
parsing = typed(Parsing, {**config["synth"], "chat_template_kwargs": {}, "trust_remote_code": False}, "synth")
run_synth(f"{w}/replies.parquet", f"{w}/responses.parquet", f"{w}/errors.jsonl", f"{w}/quality.json", parsing)
""",
    "dataset": """
from eagleflow.common.config import typed
from eagleflow.dataset import DatasetConfig, run_dataset
cfg = typed(DatasetConfig, config["dataset"], "dataset")
run_dataset(f"{w}/responses.parquet", f"{w}/quality.json", f"{w}/train.parquet", f"{w}/eval.parquet", cfg)
""",
    "vocab": """
from eagleflow.vocab import run_vocab
run_vocab(f"{w}/train.parquet", f"{w}/eval.parquet", f"{w}/verifier", config["vocab"]["draft_vocab_size"],
          f"{w}/vocab_map.safetensors", f"{w}/vocab_stats.json")
""",
    # For the ratio: the join as a stage that does not stream would do it.
    "join, whole tables": """
import pyarrow as pa, pyarrow.parquet as pq
order = {json.loads(line)["id"]: i for i, line in enumerate(open(f"{w}/prompts.jsonl"))}
table = pa.concat_tables(pq.read_table(f"{w}/shards/{i}-of-{n}/replies.parquet") for i in range(n))
position = pa.array([order[p] for p in table["prompt_id"].to_pylist()])
table = table.append_column("position", position).sort_by([("position", "ascending"), ("turn", "ascending")])
pq.write_table(table.drop_columns(["position"]), f"{w}/replies.whole.parquet")
""",
}
PRELUDE = """
import json, sys, yaml
w, n = sys.argv[1], int(sys.argv[2])
config = yaml.safe_load(open(sys.argv[3]))
"""


def make_replies(out: Path, conversations: int, shards: int, prompt_tokens: int, reply_tokens: int) -> None:
    """The prompt file and each shard's replies.parquet and stats.json under `out`."""
    from eagleflow.common.replies import replies_schema

    rng = random.Random(0)
    ids = [f"c{i:07d}" for i in range(conversations)]
    write_jsonl(out / "prompts.jsonl", [{"id": i, "turns": ["q"]} for i in ids])
    parts = [Shard(i, shards) for i in range(shards)]
    owned: dict[int, list[str]] = {p.index: [] for p in parts}
    for cid in ids:
        owned[next(p.index for p in parts if p.takes(cid))].append(cid)
    prompt = [rng.randrange(VOCAB) for _ in range(prompt_tokens)]
    reply = [rng.randrange(VOCAB) for _ in range(reply_tokens)]
    text = " ".join(f"w{t % 5000}" for t in reply)

    def body(k: int, turn: int) -> dict:
        ids = [k % VOCAB, k // VOCAB, turn, *reply[3:]]  # every stream distinct
        return {
            "id": f"chatcmpl-{k}-{turn}",
            "object": "chat.completion",
            "model": "verifier",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text, "reasoning": None},
                    "finish_reason": "stop",
                    "token_ids": ids,
                }
            ],
            "system_fingerprint": "bench",
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids)},
            "prompt_token_ids": prompt,
        }

    for part in parts:
        d = out / "shards" / part.name
        d.mkdir(parents=True)
        with parquet_rows(d / "replies.parquet", replies_schema(), batch_rows=2000) as rows:
            for k, cid in enumerate(owned[part.index]):
                for turn in range(1 + (k % 4 == 0)):
                    request = {"model": "verifier", "messages": [{"role": "user", "content": "q"}], "seed": k}
                    rows.write(
                        {
                            "id": f"{cid}#t{turn}",
                            "prompt_id": cid,
                            "turn": turn,
                            "category": None,
                            "key": f"{cid}-{turn}",
                            "request": json.dumps(request),
                            "response": json.dumps(body(int(cid[1:]), turn)),
                            "error": None,
                            "attempts": None,
                        }
                    )
        stats = {"conversations": len(owned[part.index]), "requests": rows.rows, "sent": rows.rows}
        write_json(d / "stats.json", stats)
    (out / "verifier").mkdir()
    write_json(out / "verifier/config.json", {"model_type": "llama", "vocab_size": VOCAB})


def measured(code: str, *args: str) -> str:
    """ "<wall> s, <peak RSS> MiB" of one `python -c` process (its own rusage), or how it failed."""
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", PRELUDE + code, *args], cwd=REPO, stderr=subprocess.PIPE, text=True)
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall, rss = time.monotonic() - started, usage.ru_maxrss / 1024
    if os.waitstatus_to_exitcode(status) != 0:
        return f"failed after {wall:.0f} s, {rss:,.0f} MiB: {err.strip().splitlines()[-1][:120]}"
    return f"{wall:.0f} s, {rss:,.0f} MiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--shards", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=150)
    ap.add_argument("--reply-tokens", type=int, default=400)
    ap.add_argument("--workdir", type=Path)
    args = ap.parse_args()
    config = REPO / "config/config.yaml"
    print(f"{args.shards} shards; prompts of {args.prompt_tokens} tokens, replies of {args.reply_tokens}\n")
    print("| conversations | replies on disk | " + " | ".join(STAGES) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in STAGES) + " |")
    for n in args.conversations:
        work = Path(tempfile.mkdtemp(prefix=f"cheap-{n}-", dir=args.workdir))
        try:
            make_replies(work, n, args.shards, args.prompt_tokens, args.reply_tokens)
            size = sum(p.stat().st_size for p in (work / "shards").rglob("replies.parquet")) / 2**20
            cells = [measured(code, str(work), str(args.shards), str(config)) for code in STAGES.values()]
            assert json.loads((work / "quality.json").read_text())["num_prompts"] == n
            print(f"| {n:,} | {size:,.0f} MiB | " + " | ".join(cells) + " |", flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
