"""The hf backend's extraction server (hidden_states.hf_server) as part jobs use it: each part
job (one per node) loads its own, the samples it stores equal the in-process forward, and it
is gone, with its lease, when the job returns."""

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open

from devkit.configs import hidden_states_config
from eagleflow.hidden_states.forward import extract, load_verifier
from eagleflow.hidden_states.index import write_index_of_parts
from eagleflow.hidden_states.run import content_name, run_part
from eagleflow.hidden_states.shard_reader import read_indexed
from eagleflow.hidden_states.storage import shard_bytes
from eagleflow.runtime.ledger import read_loads
from tests.helpers import HF_SETTINGS, write_dataset

NUM_PARTS = 2


def test_each_part_loads_its_own_server_and_stores_unpadded_the_in_process_forward(tiny_llama_dir, tmp_path):
    rows = write_dataset(tmp_path, 20, n_train=16)
    parts = [str(tmp_path / f"part-{k:05d}.json") for k in range(NUM_PARTS)]
    manifests = [
        run_part(
            str(tmp_path / "train.parquet"),
            str(tmp_path / "eval.parquet"),
            str(tiny_llama_dir),
            k,
            out,
            settings=hidden_states_config(**HF_SETTINGS, num_parts=NUM_PARTS),
            server=None,
            threads=1,
            gpus=0,
            trust_remote_code=False,
            log_path=str(tmp_path / f"logs/hidden_states.part-{k:05d}.log"),
        )
        for k, out in enumerate(parts)
    ]
    servers = tmp_path / "logs/servers"
    assert [(r["stage"], r["kind"], r["shared"]) for r in read_loads(servers)] == [
        ("hidden_states", "start", False)
    ] * 2
    # Each job stopped its server as it returned: no lease, no directory a later job attaches to.
    assert list(servers.glob("vllm-*.json")) == [] and list(servers.glob("shared-*")) == []
    model = load_verifier(str(tiny_llama_dir), "cpu", torch.float32)
    by_id = {r["id"]: r for r in rows}
    seen = []
    for k, (out, manifest) in enumerate(zip(parts, manifests, strict=True)):
        assert json.loads(Path(out).read_text()) == manifest
        assert (manifest["part"], manifest["num_parts"], manifest["backend"]) == (k, NUM_PARTS, "hf")
        assert manifest["stats"]["extracted_samples"] == len(manifest["samples"])
        ids = [s["id"] for s in manifest["samples"]]
        seen += ids
        # The server's forward is the one the job would run itself: same batches, same padding,
        # and one thread as the server runs (a thread count is a summation order on a CPU).
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            expected = extract(model, [by_id[i] for i in ids], [2, 4, 5], 32, torch.bfloat16) if ids else []
        finally:
            torch.set_num_threads(threads)
        for s, (aux, fin) in zip(manifest["samples"], expected, strict=True):
            n_tokens = len(by_id[s["id"]]["input_ids"])
            assert s["num_tokens"] == n_tokens and s["split"] == ("eval" if int(s["id"][1:]) >= 16 else "train")
            path = tmp_path / "samples" / s["key"][:2] / f"{s['key']}.safetensors"
            with safe_open(str(path), framework="pt") as f:
                # named by its tokens and mask, not its key (which names the software that made it)
                assert json.loads(f.metadata()["sample_ids"]) == [content_name(by_id[s["id"]])]
                assert f.metadata()["final_layer_id"] == "8" and f.metadata()["backend"] == "hf"
                hs, final = f.get_tensor("hidden_states"), f.get_tensor("verifier_last_hidden_states")
                offsets = f.get_tensor("offsets").tolist()
            assert hs.shape == (n_tokens, 3 * 128) and hs.dtype == torch.bfloat16 and final.shape == (n_tokens, 128)
            assert offsets == [0, n_tokens]
            # nothing padded: the file is what the disk check counts (header aside)
            assert (hs.numel() + final.numel()) * 2 == n_tokens * 4 * 128 * 2
            # (the safetensors header, its JSON metadata, is the rest: under 2 KB)
            assert 0 <= os.path.getsize(path) - shard_bytes(n_tokens, 1, 4, 128, "bfloat16") < 2048
            assert hs.equal(aux) and final.equal(fin)
        # read back as training reads it: the manifest's ids and splits, the same states
        for s, got, (aux, fin) in zip(manifest["samples"], read_indexed(out, torch.bfloat16), expected, strict=True):
            assert (got.id, got.is_eval) == (s["id"], s["split"] == "eval")
            assert got.aux.equal(aux) and got.final.equal(fin)
    assert sorted(seen) == sorted(by_id)  # every sample in exactly one part
    write_index_of_parts(parts, str(tiny_llama_dir), str(tmp_path / "index.json"))
    index = json.loads((tmp_path / "index.json").read_text())
    assert index["aux_layer_ids"] == [2, 4, 5] and index["vllm_layer_ids"] == [2, 4, 5, 8]
    assert index["num_samples"] == 20 and index["backends"] == ["hf"]
