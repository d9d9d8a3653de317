"""The hf backend's extraction server (hidden_states.hf_server) as shard jobs use it: loaded
once for every shard, the shards it makes equal to the in-process forward, and gone after the
linger time."""

import json
import os
import time

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from safetensors import safe_open

from devkit.configs import hidden_states_config
from eagleflow.hidden_states.forward import extract, load_verifier
from eagleflow.hidden_states.run import run_shard
from eagleflow.hidden_states.shards import write_index
from eagleflow.hidden_states.storage import shard_bytes
from eagleflow.runtime.ledger import read_loads
from eagleflow.runtime.shared import SharedDir

SETTINGS = {"backend": "hf", "batch_tokens": 32, "dtype": "bfloat16", "device": "cpu", "compute_dtype": "auto"}


def write_dataset(tmp_path, n=20):
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
    pq.write_table(pa.Table.from_pylist(rows[:16]), tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows[16:]), tmp_path / "eval.parquet")
    return rows


def test_eight_shards_share_one_load_are_unpadded_and_equal_the_in_process_forward(tiny_llama_dir, tmp_path):
    rows = write_dataset(tmp_path)
    shards = [str(tmp_path / f"shard-{k:05d}.safetensors") for k in range(8)]
    for k, out in enumerate(shards):
        run_shard(
            str(tmp_path / "train.parquet"),
            str(tmp_path / "eval.parquet"),
            str(tiny_llama_dir),
            k,
            out,
            settings=hidden_states_config(**SETTINGS, num_shards=8, linger_s=2),
            server=None,
            threads=1,
            gpus=0,
            trust_remote_code=False,
            log_path=str(tmp_path / f"logs/hidden_states.shard-{k:05d}.log"),
        )
    servers = tmp_path / "logs/servers"
    assert [(r["stage"], r["kind"], r["shared"]) for r in read_loads(servers)] == [("hidden_states", "start", True)]
    model = load_verifier(str(tiny_llama_dir), "cpu", torch.float32)
    by_id = {r["id"]: r for r in rows}
    seen = []
    for out in shards:
        with safe_open(out, framework="pt") as f:
            ids = json.loads(f.metadata()["sample_ids"])
            assert f.metadata()["final_layer_id"] == "8" and f.metadata()["backend"] == "hf"
            seen += ids
            n_tokens = sum(len(by_id[i]["input_ids"]) for i in ids)
            hs, final = f.get_tensor("hidden_states"), f.get_tensor("verifier_last_hidden_states")
            offsets = f.get_tensor("offsets").tolist()
        assert hs.shape == (n_tokens, 3 * 128) and hs.dtype == torch.bfloat16 and final.shape == (n_tokens, 128)
        assert offsets[-1] == n_tokens
        # nothing padded: the file is what the disk check counts (header aside)
        assert (hs.numel() + final.numel()) * 2 == n_tokens * 4 * 128 * 2
        # (the safetensors header, its JSON metadata, is the rest: under 2 KB)
        assert 0 <= os.path.getsize(out) - shard_bytes(n_tokens, len(ids), 4, 128, "bfloat16") < 2048
        # The server's forward is the one the job would run itself: same batches, same padding,
        # and one thread as the server runs (a thread count is a summation order on a CPU).
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            expected = extract(model, [by_id[i] for i in ids], [2, 4, 5], 32, torch.bfloat16)
        finally:
            torch.set_num_threads(threads)
        for k, (aux, fin) in enumerate(expected):
            assert hs[offsets[k] : offsets[k + 1]].equal(aux) and final[offsets[k] : offsets[k + 1]].equal(fin)
    assert sorted(seen) == sorted(by_id)
    write_index(shards, str(tiny_llama_dir), str(tmp_path / "index.json"))
    index = json.loads((tmp_path / "index.json").read_text())
    assert index["aux_layer_ids"] == [2, 4, 5] and index["vllm_layer_ids"] == [2, 4, 5, 8]
    assert index["num_samples"] == 20 and index["backends"] == ["hf"]
    # No job left: the server stops after the linger time, its lease with it.
    (shared,) = [SharedDir(p) for p in servers.glob("shared-hidden_states-*")]
    deadline = time.monotonic() + 30
    while (shared.live_state() or list(servers.glob("vllm-*.json"))) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert shared.live_state() is None and list(servers.glob("vllm-*.json")) == []
