"""Hidden states: the layer convention against a hand-written forward for every verifier
family, the shard format, the disk check, and the vLLM backend's request and file handling."""

import fcntl
import json
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import save_file

from devkit.configs import hidden_states_config
from eagleflow.hidden_states.backend import BACKENDS, open_backend
from eagleflow.hidden_states.client import (
    HiddenStatesFileError,
    completion_request,
    read_connector_output,
    split_states,
    stack_states,
    states_paths,
)
from eagleflow.hidden_states.forward import decoder_parts, extract, load_verifier, token_budget_batches
from eagleflow.hidden_states.layers import (
    VerifierGeometry,
    default_aux_layer_ids,
    resolve_aux_layer_ids,
    verifier_geometry,
)
from eagleflow.hidden_states.run import run_part
from eagleflow.hidden_states.shards import check_disk_space
from eagleflow.hidden_states.vllm import extraction_server_args
from tests.helpers import HF_SETTINGS, rel_err, write_dataset


def known_states(ids: list[int], num_states: int, hidden: int) -> torch.Tensor:
    """What the fake extraction server below writes: [tokens, num_states, hidden] in bfloat16,
    token id + 1000 x state index + column / 100."""
    t = torch.tensor(ids, dtype=torch.float32)[:, None, None]
    return (t + torch.arange(num_states)[None, :, None] * 1000 + torch.arange(hidden)[None, None, :] / 100).to(
        torch.bfloat16
    )


def manual_residual_stream(model, input_ids):
    """Inputs of every decoder layer and the pre-norm final state, computed layer by layer."""
    base, layers, _ = decoder_parts(model, model.config.num_hidden_layers)
    h = base.embed_tokens(input_ids)
    pos = torch.arange(input_ids.shape[1]).unsqueeze(0)
    pe = base.rotary_emb(h, pos)
    n = input_ids.shape[1]
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    inputs = []
    for layer in layers:
        inputs.append(h)
        h = layer(h, attention_mask=mask, position_ids=pos, position_embeddings=pe)
        h = h[0] if isinstance(h, tuple) else h
    return inputs, h


# bf16 keeps 8 mantissa bits: a stored state is within ~0.4% of the float32 one.
BF16_REL_TOL = 1e-2


@torch.inference_mode()
def test_captured_states_are_layer_inputs_and_prenorm_final(tiny_verifier):
    family, path = tiny_verifier
    model = load_verifier(str(path), "cpu", torch.float32, trust_remote_code=family == "kimi_k2")
    ids = [[5, 17, 42, 7, 99, 3, 11], [8, 9, 10]]
    aux_ids = default_aux_layer_ids(model.config.num_hidden_layers)
    assert aux_ids == [2, 4, 5]
    exact = extract(model, [{"input_ids": x} for x in ids], aux_ids, batch_tokens=64, store_dtype=torch.float32)
    stored = extract(model, [{"input_ids": x} for x in ids], aux_ids, batch_tokens=64, store_dtype=torch.bfloat16)
    _, _, norm = decoder_parts(model, model.config.num_hidden_layers)
    for (aux, final), (aux16, final16), x in zip(exact, stored, ids, strict=True):
        layer_inputs, pre_norm = manual_residual_stream(model, torch.tensor([x]))
        expected_aux = torch.cat([layer_inputs[i][0] for i in aux_ids], dim=-1)
        torch.testing.assert_close(aux, expected_aux, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(final, pre_norm[0], rtol=1e-4, atol=1e-4)
        assert aux16.dtype == final16.dtype == torch.bfloat16
        assert rel_err(aux16, expected_aux) < BF16_REL_TOL
        assert rel_err(final16, pre_norm[0]) < BF16_REL_TOL
        # A post-norm final state or an off-by-one layer must not pass at that tolerance.
        assert rel_err(final16, norm(pre_norm)[0]) > BF16_REL_TOL
        for shift in (-1, 1):
            wrong = torch.cat([layer_inputs[i + shift][0] for i in aux_ids], dim=-1)
            assert rel_err(aux16, wrong) > BF16_REL_TOL, f"aux layers shifted by {shift} pass the check"


def test_decoder_parts_finds_nested_language_models(tiny_llama_dir):
    """Multimodal wrappers (Kimi-K2.5) keep the decoder under another attribute path."""
    inner = load_verifier(str(tiny_llama_dir), "cpu", torch.float32)

    class Wrapper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.vision_tower = torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(3)])
            self.language_model = inner

    base, layers, norm = decoder_parts(Wrapper(), 8)
    assert base is inner.model and layers is inner.model.layers and norm is inner.model.norm
    with pytest.raises(ValueError, match="no ModuleList of 9 decoder layers"):
        decoder_parts(Wrapper(), 9)


def test_batched_and_single_extraction_agree(tiny_llama_dir):
    model = load_verifier(str(tiny_llama_dir), "cpu", torch.float32)
    samples = [{"input_ids": list(range(3, 3 + n))} for n in (9, 4, 6)]
    batched = extract(model, samples, [1, 2, 4], batch_tokens=64, store_dtype=torch.float32)
    single = extract(model, samples, [1, 2, 4], batch_tokens=1, store_dtype=torch.float32)
    for (a1, f1), (a2, f2) in zip(batched, single, strict=True):
        torch.testing.assert_close(a1, a2, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(f1, f2, rtol=1e-4, atol=1e-4)


def test_token_budget_batches():
    batches = token_budget_batches([5, 1, 9, 3], batch_tokens=10)
    assert sorted(i for b in batches for i in b) == [0, 1, 2, 3]
    assert batches == [[1, 3], [0], [2]]


def test_small_verifiers_get_distinct_default_aux_layers_past_the_embeddings():
    assert default_aux_layer_ids(8) == [2, 4, 5] and default_aux_layer_ids(61) == [2, 30, 58]
    for layers in range(2, 8):
        ids = resolve_aux_layer_ids(None, VerifierGeometry(layers, 64, deepseek=True))  # raises if they collide
        assert ids[0] >= 1 and ids[-1] == layers - 1 and len(ids) == min(3, layers - 1)
    assert default_aux_layer_ids(6) == [1, 3, 5] and default_aux_layer_ids(4) == [1, 2, 3]
    with pytest.raises(ValueError, match="1 layer"):
        default_aux_layer_ids(1)


def test_aux_layer_ids_validation():
    llama, deepseek = VerifierGeometry(30, 64), VerifierGeometry(30, 64, deepseek=True)
    assert resolve_aux_layer_ids(None, llama) == [2, 15, 27]
    assert resolve_aux_layer_ids([1, 3], llama) == [1, 3]
    for bad in ([2, 2, 5], [2, 30], [5, 2]):
        with pytest.raises(ValueError, match="aux_layer_ids"):
            resolve_aux_layer_ids(bad, llama)
    # Layer 0's input is servable on Llama, not by vLLM's DeepseekV2 forward.
    assert resolve_aux_layer_ids([0, 3], llama) == [0, 3]
    with pytest.raises(ValueError, match="DeepseekV2.*layer 1"):
        resolve_aux_layer_ids([0, 3], deepseek)


def test_geometry_comes_from_config_json_including_text_config(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "kimi_k25",
                "text_config": {"model_type": "deepseek_v3", "num_hidden_layers": 61, "hidden_size": 7168},
            }
        )
    )
    geometry = verifier_geometry(str(tmp_path))
    assert (geometry.num_layers, geometry.hidden_size, geometry.deepseek) == (61, 7168, True)
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576})
    )
    assert not verifier_geometry(str(tmp_path)).deepseek
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "x"}))
    with pytest.raises(ValueError, match="config.json"):
        verifier_geometry(str(tmp_path))


def run_hf_part(
    tmp_path, verifier, part: int, out: str, num_parts: int, force: bool = False, store_location=None, **settings
) -> dict:
    """Part `part` of `num_parts` of write_dataset's data, by the hf backend on CPU, stored
    beside `out` or in the bucket `store_location`."""
    return run_part(
        str(tmp_path / "train.parquet"),
        str(tmp_path / "eval.parquet"),
        str(verifier),
        part,
        out,
        settings=hidden_states_config(**HF_SETTINGS, num_parts=num_parts, **settings),
        server=None,
        threads=1,
        gpus=0,
        trust_remote_code=False,
        log_path=str(tmp_path / f"logs/hidden_states.part-{part:05d}.log"),
        force=force,
        store_location=store_location,
    )


def test_disk_check_logs_the_total_and_refuses_without_room(tmp_path, caplog, monkeypatch):
    caplog.set_level("INFO")
    need = check_disk_space(
        tmp_path, num_tokens=1000, num_samples=10, num_states=4, hidden_size=576, storage="bfloat16"
    )
    assert need == 1000 * (4 * 576 * 2 + 5) + 10 * 41
    assert str(need) in caplog.text
    import eagleflow.hidden_states.shards as hs

    monkeypatch.setattr(hs.shutil, "disk_usage", lambda p: type("U", (), {"free": need - 1})())
    with pytest.raises(OSError) as err:
        check_disk_space(tmp_path, num_tokens=1000, num_samples=10, num_states=4, hidden_size=576, storage="bfloat16")
    assert "float8_e4m3fn" in str(err.value) and "hidden_states.mode: online" in str(err.value)
    assert f"need {need} bytes" in str(err.value) and f"only {need - 1} bytes" in str(err.value)


def test_a_part_refuses_before_loading_the_verifier(tiny_llama_dir, tmp_path, monkeypatch):
    write_dataset(tmp_path)
    import eagleflow.hidden_states.hf as hf
    import eagleflow.hidden_states.shards as shards

    monkeypatch.setattr(shards.shutil, "disk_usage", lambda p: type("U", (), {"free": 10})())
    monkeypatch.setattr(hf, "launched", lambda *a, **k: pytest.fail("started the verifier before the disk check"))
    out = tmp_path / "hs/part-00000.json"
    with pytest.raises(OSError, match="only 10 bytes"):
        run_hf_part(tmp_path, tiny_llama_dir, 0, str(out), num_parts=1)
    assert not out.exists()


class Killed(Exception):
    """The job dies here."""


def stored(out) -> list:
    return sorted(p.name for p in (Path(out).parent / "samples").glob("*/*.safetensors"))


def test_a_failed_extraction_keeps_each_finished_chunk_and_nothing_half_written(tiny_llama_dir, tmp_path, monkeypatch):
    """A job killed mid-part leaves whole sample files only, and no manifest: the rerun
    extracts what is missing and nothing it stored."""
    write_dataset(tmp_path)
    import eagleflow.hidden_states.run as run

    out = tmp_path / "hs/part-00000.json"
    real = run.open_backend
    calls = []
    dying = [True]

    def dies_on_the_second_chunk(name, job):
        backend = real(name, job)

        class Wrapped:
            def __enter__(self):
                inner = backend.__enter__()

                class Dies:
                    def extract(self, samples, *a, **k):
                        calls.append([s["id"] for s in samples])
                        if len(calls) == 2 and dying:
                            raise Killed
                        return inner.extract(samples, *a, **k)

                return Dies()

            def __exit__(self, *exc):
                return backend.__exit__(*exc)

        return Wrapped()

    monkeypatch.setattr(run, "open_backend", dies_on_the_second_chunk)
    with pytest.raises(Killed):  # the 7 samples of 3..9 tokens, stored every 12 tokens
        run_hf_part(tmp_path, tiny_llama_dir, 0, str(out), num_parts=1, store_every_tokens=12)
    assert not out.exists()
    first_chunk = calls[0]
    assert len(stored(out)) == len(first_chunk) and [p for p in (tmp_path / "hs").rglob("*") if "tmp" in p.name] == []
    calls.clear()
    dying.clear()
    manifest = run_hf_part(tmp_path, tiny_llama_dir, 0, str(out), num_parts=1, store_every_tokens=12)
    again = [i for chunk in calls for i in chunk]
    assert set(again).isdisjoint(first_chunk) and len(again) == 7 - len(first_chunk)
    assert manifest["stats"]["stored_samples"] == len(first_chunk) and manifest["stats"]["extracted_samples"] == len(
        again
    )
    assert len(stored(out)) == 7


def test_a_grown_dataset_extracts_only_its_new_samples_and_a_changed_one_only_itself(tiny_llama_dir, tmp_path):
    """The store keys a sample by its tokens and loss mask (and the extraction's settings),
    not its id or split, so unchanged samples never reach the verifier again."""
    rows = write_dataset(tmp_path, n=7)
    parts = [tmp_path / f"hs/part-{k:05d}.json" for k in range(2)]
    first = [run_hf_part(tmp_path, tiny_llama_dir, k, str(p), num_parts=2) for k, p in enumerate(parts)]
    assert sum(m["stats"]["extracted_samples"] for m in first) == 7
    before = {s["id"]: s["digest"] for m in first for s in m["samples"]}
    # Three new conversations, and one changed (its reply ends otherwise).
    new = [
        {**rows[0], "id": f"n{i}", "input_ids": [9, 8, 7 + i, 6], "loss_mask": [0, 1, 1, 1], "length": 4}
        for i in range(3)
    ]
    changed = {**rows[1], "input_ids": rows[1]["input_ids"][:-1] + [11], "loss_mask": rows[1]["loss_mask"]}
    grown = [rows[0], changed, *rows[2:5], *new]
    pq.write_table(pa.Table.from_pylist(grown), tmp_path / "train.parquet")
    second = [run_hf_part(tmp_path, tiny_llama_dir, k, str(p), num_parts=2) for k, p in enumerate(parts)]
    assert sum(m["stats"]["extracted_samples"] for m in second) == 4  # the 3 new and the changed one
    assert sum(m["stats"]["stored_samples"] for m in second) == 6
    assert sum(m["stats"]["verifier_loads"] for m in second) == sum(
        bool(m["stats"]["extracted_samples"]) for m in second
    )
    after = {s["id"]: s["digest"] for m in second for s in m["samples"]}
    assert {i for i in before if i in after and after[i] == before[i]} == {r["id"] for r in rows} - {"s1"}
    # The index over both parts reads back each sample's own tokens under its id and split.
    from eagleflow.hidden_states.index import write_index_of_parts
    from eagleflow.hidden_states.shard_reader import read_indexed

    doc = write_index_of_parts(
        [str(p) for p in parts], str(tiny_llama_dir), str(tmp_path / "hs/index.json"), str(tmp_path / "hs/stats.json")
    )
    assert doc["num_samples"] == 10 and json.loads((tmp_path / "hs/stats.json").read_text())["extracted_samples"] == 4
    want = {r["id"]: r for r in [*grown, *rows[5:]]}
    for sample in read_indexed(tmp_path / "hs/index.json"):
        assert sample.input_ids.tolist() == list(want[sample.id]["input_ids"])
        assert sample.is_eval == (sample.id in {"s5", "s6"})
    # A forced rerun (-R) extracts every sample of the part again, to the same states.
    forced = run_hf_part(tmp_path, tiny_llama_dir, 0, str(parts[0]), num_parts=2, force=True)
    assert forced["stats"]["extracted_samples"] == len(forced["samples"])
    assert [s["digest"] for s in forced["samples"]] == [s["digest"] for s in second[0]["samples"]]


def test_a_sample_joins_one_part_and_moves_no_other():
    from eagleflow.hidden_states.sample_keys import part_of

    ids = [f"p{i}#t0" for i in range(400)]
    assign = {i: part_of(i, 4) for i in ids}
    assert set(assign.values()) == {0, 1, 2, 3} and max(list(assign.values()).count(k) for k in range(4)) < 140
    assert all(part_of(i, 5) == part_of(i, 5) for i in ids) and part_of("p1#t0", 4) == assign["p1#t0"]


def test_a_sample_key_is_its_tokens_and_mask_under_the_settings_whatever_holds_them():
    import numpy as np

    from eagleflow.hidden_states.sample_keys import sample_key

    ids, mask = [5, 6, 7], [0, 1, 1]
    key = sample_key("s", ids, mask)
    # The job keys lists, the plan numpy slices of the dataset's columns: the same key.
    assert key == sample_key("s", np.array(ids, dtype=np.int32), np.array(mask, dtype=np.int8))
    assert (
        len({key, sample_key("t", ids, mask), sample_key("s", [5, 6, 8], mask), sample_key("s", ids, [1, 1, 1])}) == 4
    )
    # Where the tokens end and the mask begins counts: no two splits of one sequence collide.
    assert sample_key("s", [1, 2], [3]) != sample_key("s", [1], [2, 3])


def test_prune_removes_the_stored_samples_no_index_names(tmp_path):
    from eagleflow.runtime.state_store import SampleStore, prune_unreferenced

    states = tmp_path / "results/run/hidden_states"
    store = SampleStore(states / "samples")
    for key in ("aa11", "bb22", "cc33"):
        store.path(key).parent.mkdir(parents=True, exist_ok=True)
        store.path(key).write_bytes(b"x" * 10)
    (states / "part-00000.json").write_text(json.dumps({"samples": [{"key": "aa11"}]}))
    (states / "index.json").write_text(json.dumps({"samples": [{"key": "bb22"}]}))
    assert prune_unreferenced(tmp_path / "results", dry_run=True) == [(states / "samples", 1, 10)]
    assert store.has("cc33")
    prune_unreferenced(tmp_path / "results")
    assert sorted(store.keys()) == ["aa11", "bb22"]


def test_unknown_backend_names_the_known_ones(tmp_path):
    assert sorted(BACKENDS) == ["hf", "vllm"]
    with pytest.raises(ValueError, match=r"'tgi'.*\['hf', 'vllm'\]"):
        open_backend("tgi", None)


# --- vllm backend: what can be checked without an accelerator --------------------------


def test_extraction_server_args_ask_for_aux_and_final_layers(tmp_path):
    spec, args = extraction_server_args([2, 15, 27], 30, str(tmp_path))
    assert spec["method"] == "extract_hidden_states" and spec["num_speculative_tokens"] == 1
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27, 30]
    kv = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert kv["kv_connector"] == "EagleflowHiddenStatesConnector" and kv["kv_role"] == "kv_producer"
    assert kv["kv_connector_extra_config"]["shared_storage_path"] == str(tmp_path)
    assert "--no-enable-prefix-caching" in args


def test_vllm_accepts_the_extraction_config():
    """vLLM's own config classes parse what we send (no engine needed)."""
    pytest.importorskip("vllm")
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    _, args = extraction_server_args([2, 4, 5], 8, "/tmp/x")
    kv = KVTransferConfig(**json.loads(args[args.index("--kv-transfer-config") + 1]))
    connector = KVConnectorFactory.get_connector_class(kv)
    assert connector.__name__ == "EagleflowHiddenStatesConnector"
    assert issubclass(connector, KVConnectorFactory.get_connector_class_by_name("ExampleHiddenStatesConnector"))


def test_the_connector_gathers_a_requests_slots_in_token_order_and_refuses_unchecked_vllm():
    pytest.importorskip("vllm")
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import extract_from_kv_cache

    from eagleflow.hidden_states.vllm_connector import (
        CHECKED_VLLM_VERSIONS,
        UnsupportedVllmError,
        check_vllm_version,
        slot_mapping,
    )

    assert slot_mapping([3, 1], 4).tolist() == [12, 13, 14, 15, 4, 5, 6, 7]
    # A cache [blocks, states, block size, hidden] whose slot s holds s: a request of 6 tokens
    # in blocks 3 then 1 reads its tokens in order, as copies.
    cache = torch.arange(5 * 4, dtype=torch.float32).reshape(5, 1, 4, 1).expand(5, 2, 4, 3).contiguous()
    got = extract_from_kv_cache(cache, slot_mapping([3, 1], 4), 6)
    assert got.shape == (6, 2, 3) and got[:, 0, 0].tolist() == [12, 13, 14, 15, 4, 5]
    got += 1
    assert cache[3, 0, 0, 0] == 12  # the write outlives the blocks the scheduler frees
    check_vllm_version(CHECKED_VLLM_VERSIONS[0])
    check_vllm_version(CHECKED_VLLM_VERSIONS[0] + "+cpu")
    with pytest.raises(UnsupportedVllmError, match=r"checked against vLLM 0\.32\.0, not 0\.33\.0"):
        check_vllm_version("0.33.0")


def test_completion_request_sends_exact_tokens():
    body = completion_request([5, 6, 7], "verifier")
    assert body["prompt"] == [5, 6, 7] and body["max_tokens"] == 1 and body["model"] == "verifier"
    assert body["kv_transfer_params"] == {"include_output_tokens": False}
    batch = completion_request([[5, 6], [7]], "hf")
    assert batch["prompt"] == [[5, 6], [7]]


def test_a_reply_names_one_states_file_per_sample():
    assert states_paths({"kv_transfer_params": {"hidden_states_path": "/a"}}, 1) == ["/a"]
    assert states_paths({"kv_transfer_params": {"hidden_states_paths": ["/a", "/b"]}}, 2) == ["/a", "/b"]
    assert states_paths({"kv_transfer_params": None}, 1) is None
    with pytest.raises(HiddenStatesFileError, match="names 1 states files for 2 samples"):
        states_paths({"kv_transfer_params": {"hidden_states_paths": ["/a"]}}, 2)


def test_stack_states_is_the_inverse_of_split_states():
    aux, final = torch.randn(5, 3 * 4), torch.randn(5, 4)
    stacked = stack_states(aux, final)
    assert stacked.shape == (5, 4, 4)
    again = split_states(stacked, 3)
    assert again[0].equal(aux) and again[1].equal(final)


def connector_file(path, ids, n_states=4, hidden=8):
    stacked = torch.randn(len(ids), n_states, hidden, dtype=torch.bfloat16)
    save_file({"hidden_states": stacked, "token_ids": torch.tensor(ids)}, str(path))
    return stacked


def test_split_states_keeps_layer_order():
    stacked = torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(2, 4, 3)
    aux, final = split_states(stacked, 3)
    assert aux.shape == (2, 9) and final.shape == (2, 3)
    torch.testing.assert_close(aux[1], stacked[1, :3].flatten())
    torch.testing.assert_close(final, stacked[:, 3])
    with pytest.raises(HiddenStatesFileError, match="expected 3 states"):
        split_states(stacked, 2)


def test_read_connector_output_checks_and_removes_the_file(tmp_path):
    path = tmp_path / "req-1.safetensors"
    stacked = connector_file(path, [3, 4, 5])
    (tmp_path / "req-1.safetensors.lock").touch()
    aux, final = read_connector_output(
        str(path), {"id": "s1", "input_ids": [3, 4, 5]}, 3, 8, torch.float32, timeout_s=5
    )
    assert aux.dtype == torch.float32 and aux.shape == (3, 24)
    torch.testing.assert_close(final, stacked[:, 3].float())
    assert list(tmp_path.iterdir()) == []


def test_read_connector_output_waits_for_the_writer_lock(tmp_path):
    path = tmp_path / "req-2.safetensors"
    lock = open(f"{path}.lock", "w")  # noqa: SIM115 (held across the test's steps)
    fcntl.flock(lock, fcntl.LOCK_EX)

    def finish():
        time.sleep(0.3)
        connector_file(path, [1, 2])
        lock.close()  # releases LOCK_EX, as the connector's writer thread does

    writer = threading.Thread(target=finish)
    writer.start()
    aux, _ = read_connector_output(str(path), {"id": "s2", "input_ids": [1, 2]}, 3, 8, torch.bfloat16, timeout_s=10)
    writer.join()
    assert aux.shape == (2, 24)


def test_read_connector_output_errors_name_the_sample(tmp_path):
    path = tmp_path / "r.safetensors"
    connector_file(path, [1, 2, 3])
    with pytest.raises(HiddenStatesFileError, match="sample s9: .* differ"):
        read_connector_output(str(path), {"id": "s9", "input_ids": [1, 2, 4]}, 3, 8, torch.bfloat16, timeout_s=1)
    with pytest.raises(HiddenStatesFileError, match=r"sample s9: .*\(3, 4, 16\)"):
        read_connector_output(str(path), {"id": "s9", "input_ids": [1, 2, 3]}, 3, 16, torch.bfloat16, timeout_s=1)
    with pytest.raises(HiddenStatesFileError, match="does not exist"):
        read_connector_output(
            str(tmp_path / "missing.safetensors"), {"id": "s9", "input_ids": [1]}, 3, 8, torch.bfloat16, timeout_s=0.1
        )
    lock = open(tmp_path / "r.safetensors.lock", "w")  # noqa: SIM115 (held across the test's steps)
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        with pytest.raises(HiddenStatesFileError, match="still writing"):
            read_connector_output(str(path), {"id": "s9", "input_ids": [1, 2, 3]}, 3, 8, torch.bfloat16, timeout_s=0.2)
    finally:
        lock.close()


class FakeExtractionServer:
    """Stands in for vLLM's HTTP side only, for what a real vLLM cannot be made to do (503s,
    a reply that names no file; tests/integration/test_vllm_extraction.py runs the real one):
    for each completion it writes the file ExampleHiddenStatesConnector would write and
    names it in kv_transfer_params. The states are a known function of the tokens."""

    def __init__(self, storage, num_states, hidden, drop_path_for=None, unavailable_first=0):
        import http.server

        self.storage, self.num_states, self.hidden, self.drop_path_for = storage, num_states, hidden, drop_path_for
        self.unavailable_left, self.requests = unavailable_first, 0
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests += 1
                if fake.unavailable_left > 0:  # a server that is briefly overloaded
                    fake.unavailable_left -= 1
                    self.send_response(503)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                ids = body["prompt"]
                path = fake.storage / f"cmpl-{len(list(fake.storage.iterdir()))}-{ids[0]}-{len(ids)}.safetensors"
                save_file({"hidden_states": fake.states(ids), "token_ids": torch.tensor(ids)}, str(path))
                reply = {
                    "choices": [{"text": "x"}],
                    "kv_transfer_params": None if ids == fake.drop_path_for else {"hidden_states_path": str(path)},
                }
                data = json.dumps(reply).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def states(self, ids):
        return known_states(ids, self.num_states, self.hidden)

    def close(self):
        self.server.shutdown()


def vllm_backend_for(fake: FakeExtractionServer, concurrency: int):
    from eagleflow.hidden_states.client import ExtractionClient
    from eagleflow.runtime.concurrency import Concurrency
    from eagleflow.runtime.recovery import WaitForEndpoint

    return ExtractionClient(
        fake.url,
        "verifier",
        num_aux=3,
        hidden_size=8,
        store_dtype=torch.bfloat16,
        limit=Concurrency(concurrency, adaptive=False),
        request_timeout_s=10,
        recovery=WaitForEndpoint(0),
    )


def test_vllm_backend_reassembles_unpadded_states_in_sample_order(tmp_path):
    fake = FakeExtractionServer(tmp_path, num_states=4, hidden=8)
    try:
        backend = vllm_backend_for(fake, concurrency=4)
        samples = [{"id": f"s{i}", "input_ids": list(range(10 * i + 1, 10 * i + 2 + i))} for i in range(6)]
        states = backend.extract(samples)
    finally:
        fake.close()
    for s, (aux, final) in zip(samples, states, strict=True):
        expected = fake.states(s["input_ids"])
        assert aux.shape == (len(s["input_ids"]), 24) and final.shape == (len(s["input_ids"]), 8)
        torch.testing.assert_close(aux, expected[:, :3].reshape(len(s["input_ids"]), 24))
        torch.testing.assert_close(final, expected[:, 3])
    assert list(tmp_path.iterdir()) == []  # every connector file consumed


def test_vllm_backend_retries_a_briefly_unavailable_server(tmp_path):
    fake = FakeExtractionServer(tmp_path, num_states=4, hidden=8, unavailable_first=2)
    try:
        backend = vllm_backend_for(fake, concurrency=1)
        ((aux, final),) = backend.extract([{"id": "s0", "input_ids": [5, 6, 7]}])
    finally:
        fake.close()
    assert fake.requests == 3  # two 503s, then the answer
    torch.testing.assert_close(final, fake.states([5, 6, 7])[:, 3])


def test_vllm_backend_reply_without_states_path_is_an_error(tmp_path):
    fake = FakeExtractionServer(tmp_path, num_states=4, hidden=8, drop_path_for=[7, 8])
    try:
        backend = vllm_backend_for(fake, concurrency=2)
        with pytest.raises(HiddenStatesFileError, match="sample bad: .*no kv_transfer_params.hidden_states_path"):
            backend.extract([{"id": "ok", "input_ids": [1, 2]}, {"id": "bad", "input_ids": [7, 8]}])
    finally:
        fake.close()


def test_the_shard_key_ignores_operational_settings_and_follows_content():
    from eagleflow.hidden_states.run import content_settings

    base = hidden_states_config(backend="hf", num_parts=2)

    def settings(**kw):
        return content_settings(
            hidden_states_config(**{"backend": "hf", "num_parts": 2, **kw}), None, [2, 4, 5], False, "c"
        )

    assert settings(linger_s=1, num_parts=4, vllm={"concurrency": 3}) == content_settings(
        base, None, [2, 4, 5], False, "c"
    )
    assert settings(dtype="float32") != settings()
    assert content_settings(base, None, [2, 4, 5], False, "other code") != settings()
