"""Which server flags reach the cache keys (runtime/server_args.py), by runtime/vllm_flags/'s
table (vLLM's options as its parser reads them, and eagleflow's list of the run-only ones),
and whether that table still describes the vLLM that is installed."""

import argparse
import itertools
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from devkit import vllm_options
from eagleflow.runtime import vllm_flags
from eagleflow.runtime.server_args import RUN_ONLY_FLAGS, result_args, server_args
from eagleflow.runtime.vllm_flags import FLAGS, RESULT, RUN_ONLY, RUN_ONLY_OPTIONS

LAUNCHER = ["python", "-m", "vllm.entrypoints.openai.api_server"]
BASE = ["--model", "/verifier", "--port", "8000", "--dtype", "float32", "--max-model-len", "2048"]


def key(*extra: str) -> list[list[str]]:
    """result_args of the launcher's usual argv with `extra` flags after it."""
    return result_args([*LAUNCHER, *BASE, *extra])


def test_short_long_and_attached_spellings_are_one_key():
    spellings = [["-q", "fp8"], ["--quantization", "fp8"], ["--quantization=fp8"], ["-q=fp8"], ["-qfp8"]]
    keys = [key(*s) for s in spellings]
    assert all(k == keys[0] for k in keys), keys
    assert ["--quantization", "fp8"] in keys[0]
    assert keys[0] != key()


def test_numerics_flags_change_the_key():
    """Parallel sizes change reduction order, eager mode and -O the kernels and fusions."""
    base = key()
    for changed in (["-tp", "2"], ["-pp", "2"], ["-O0"], ["--enforce-eager"], ["-ep"], ["--kv-cache-dtype", "fp8"]):
        assert key(*changed) != base, changed
    assert key("-tp", "2") == key("--tensor-parallel-size=2") == key("--tensor_parallel_size", "2")
    assert key("-O3") == key("-O", "3") == key("-O=3") == key("--optimization-level", "3") != key("-O0")
    assert key("--enforce-eager") != key("--no-enforce-eager")
    # FlexibleArgumentParser passes whatever follows -O on as the level, `.mode=3` too.
    assert key("-O.mode=3") == key("--optimization-level", ".mode=3")


def test_capacity_placement_and_operation_change_nothing():
    base = key()
    for run_only in (
        ["--gpu-memory-utilization", "0.90"],
        ["--gpu-memory-utilization", "0.92"],
        ["--device-memory-utilization", "0.5"],
        ["--max-num-seqs", "8"],
        ["--max-num-batched-tokens", "4k"],
        ["--port", "9"],
        ["--host", "0.0.0.0"],
        ["--served-model-name", "a", "b"],
        ["--enable-prefix-caching"],
        ["--no-enable-prefix-caching"],
        ["--disable-log-stats", "--uvicorn-log-level", "debug", "--api-key", "k1", "k2"],
        ["--distributed-executor-backend", "ray", "-dpb", "mp", "--cpu-offload-gb", "4"],
    ):
        assert key(*run_only) == base, run_only


def test_underscores_prefixes_and_equals_name_the_same_flag():
    expected = key("--max-model-len", "4096")
    assert expected != key()
    for spelling in (["--max_model_len", "4096"], ["--max-model-len=4096"], ["--max_model-len=4096"]):
        assert key(*spelling) == expected, spelling
    # argparse's allow_abbrev (on in vLLM): a unique prefix names the flag.
    assert key("--max-model", "4096") == expected


def test_order_does_not_matter_and_the_last_occurrence_wins():
    flags = [["--seed", "3"], ["-tp", "2"], ["--enforce-eager"], ["--reasoning-parser", "qwen3"]]
    keys = {str(key(*itertools.chain(*order))) for order in itertools.permutations(flags)}
    assert len(keys) == 1
    assert key("--seed", "1", "--seed=2") == key("--seed", "2") != key("--seed", "1")
    # A negation replaces the flag it negates, whichever comes last.
    assert key("--enforce-eager", "--no-enforce-eager") == key("--no-enforce-eager")
    assert key("--no-enforce-eager", "--enforce-eager") == key("--enforce-eager")


def test_json_values_are_canonical():
    a = key("--speculative-config", '{"a": 1, "b": {"d": 2, "c": [3, 1]}}')
    assert (
        a == key("--speculative-config", '{"b":{"c":[3,1],"d":2},"a":1}') == key("-sc", '{"b":{"c":[3,1],"d":2},"a":1}')
    )
    assert a != key("--speculative-config", '{"a": 1, "b": {"d": 2, "c": [1, 3]}}')
    # FlexibleArgumentParser's dotted keys build the same dict.
    assert key("--speculative-config.a", "1", "--speculative_config.b.d=2", "--speculative-config.b.c+", "3,1") == key(
        "--speculative-config", '{"a": 1, "b": {"c": ["3", "1"], "d": 2}}'
    )
    # vLLM appends the dotted dict after every other argument: it replaces a JSON value.
    assert key("--compilation-config.mode", "3", "--compilation-config", '{"mode": 0}') == key(
        "--compilation-config", '{"mode": 3}'
    )


def test_values_that_look_like_flags_and_lists():
    assert ["--seed", "-1"] in key("--seed", "-1")
    assert ["--lora-modules", "a=/x", "b=/y"] in key("--lora-modules", "a=/x", "b=/y", "--enforce-eager")
    assert ["--chat-template", "-x y"] in key("--chat-template", "-x y")  # a space: argparse's value
    assert ["--hf-overrides", '{"rope_theta":1}'] in key("--hf-overrides", '{"rope_theta": 1}')


def test_unique_prefixes_name_a_flag_and_ambiguous_ones_are_refused():
    """argparse's allow_abbrev, as vLLM's parser has it: a unique prefix names its flag (a
    negation's too), an exact name wins over the longer names it begins, an ambiguous prefix
    is refused with the flags it could name."""
    assert key("--enforce") == key("--enforce-eager") != key("--no-enforce") == key("--no-enforce-eager")
    assert server_args(["--model", "/m"]) == [["--model", "/m"]]  # not --model-impl
    with pytest.raises(ValueError, match="ambiguous option: --max-num could match") as refused:
        key("--max-num", "8")
    assert {"--max-num-seqs", "--max-num-batched-tokens"} <= set(str(refused.value).replace(",", " ").split())


def test_negation_is_vllms_where_it_defines_one():
    """`--no-x` is the value False of a BooleanOptionalAction `--x`; where vLLM defines no such
    negation, `--no-x` is a flag it does not know, kept as given (and counted)."""
    assert "--no-enforce-eager" in FLAGS["--enforce-eager"].aliases
    assert server_args(["--enforce-eager", "--no-enforce_eager"]) == [["--no-enforce-eager"]]
    assert "--no-seed" not in FLAGS["--seed"].aliases
    assert server_args(["--seed", "1", "--no-seed"]) == [["--no-seed"], ["--seed", "1"]]
    assert key("--no-seed") != key()


def test_values_given_with_equals_are_the_flags_only_value():
    assert server_args(["--max-model=4k"]) == [["--max-model-len", "4k"]]
    assert server_args(["--chat-template="]) == [["--chat-template", ""]]
    assert server_args(["--lora-modules=a=/x", "--seed=-1"]) == [["--lora-modules", "a=/x"], ["--seed", "-1"]]
    with pytest.raises(ValueError, match="'b=/y' after --lora-modules=a=/x is no flag's value"):
        server_args(["--lora-modules=a=/x", "b=/y"])


def test_json_values_each_canonical_and_appends_each_kept():
    lora = ['{"path": "/x", "name": "a"}', "b=/y"]
    assert server_args(["--lora-modules", *lora]) == [["--lora-modules", '{"name":"a","path":"/x"}', "b=/y"]]
    assert server_args([*LAUNCHER, '-cc={"b": 1, "a": [2, 1]}']) == [["--compilation-config", '{"a":[2,1],"b":1}']]
    assert server_args(["--hf-overrides", "1"]) == [["--hf-overrides", "1"]]  # JSON, but no object: as given
    middleware = ["--middleware", "m1", "--middleware", "m2"]  # argparse's `append`
    assert server_args(middleware) == [["--middleware", "m1"], ["--middleware", "m2"]]


def test_every_spelling_of_every_option_names_it():
    """Each option in each spelling options.json records, with values for its arity, is read
    under its canonical name (a negation as itself), with those values."""
    for flag, spec in FLAGS.items():
        values = {0: [], 1: ["1"], "?": ["1"], "+": ["1", "2"], "*": ["1", "2"]}[spec.arity]
        for spelling in (flag, *spec.aliases) if flag != "--config" else ():
            named = spelling if spelling == f"--no-{flag[2:]}" else flag
            assert server_args([*LAUNCHER, spelling, *values]) == [[named, *values]], spelling


def test_reading_an_argv_imports_no_vllm():
    """Keys are computed while Snakemake builds the DAG, where vLLM may be absent."""
    workflow = Path(vllm_flags.__file__).parents[3]
    code = (
        f"import sys; sys.path.insert(0, {str(workflow)!r}); "
        "from eagleflow.runtime.server_args import result_args; result_args(['--model', 'm', '-tp', '2']); "
        "assert not [m for m in sys.modules if m.split('.')[0] == 'vllm'], 'vLLM was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_unknown_flags_count_with_their_values_as_given():
    argv = [*LAUNCHER, "--model", "/m", "--port", "1", "--dtype", "bf16", "--enforce-eager"]
    argv += ["--compilation-config", '{"custom_ops": ["-rotary_embedding"]}', "--x=1", "--flag", "--y", "a", "b"]
    assert result_args(argv) == [
        ["--compilation-config", '{"custom_ops":["-rotary_embedding"]}'],
        ["--dtype", "bf16"],
        ["--enforce-eager"],
        ["--flag"],
        ["--x", "1"],
        ["--y", "a", "b"],
    ]
    assert result_args(["vllm", "serve"]) == []


def test_the_launcher_is_not_read_as_flags():
    expected = [["--port", "8"], ["--tensor-parallel-size", "2"]]
    for launcher in (
        ["vllm", "serve", "MODEL"],
        ["python", "-O", "-m", "vllm.entrypoints.openai.api_server"],
        ["python", "-m", "vllm.entrypoints.cli.main", "serve", "MODEL"],
        ["srun", "-n", "1", "vllm", "serve"],
    ):
        assert server_args([*launcher, "-tp", "2", "--port", "8"]) == expected, launcher
    # Another launcher's own options: vLLM's begin at the first long flag.
    assert server_args(["srun", "-n", "1", "--port", "8", "-tp", "2"]) == expected


@pytest.mark.parametrize(
    "extra, error",
    [
        (["--enforce-eager", "true"], "'true' after --enforce-eager is no flag's value"),
        (["--enforce-eager=1"], "argument --enforce-eager/--no-enforce-eager: ignored explicit argument '1'"),
        (["--seed"], "argument --seed: expected one argument"),
        (["--seed", "--enforce-eager"], "argument --seed: expected one argument"),
        (["--lora-modules"], "argument --lora-modules: expected at least one argument"),
        (["--config", "serve.yaml"], "--config reads flags from a file"),
        (["--enable-lo", "x"], "ambiguous option: --enable-lo could match"),
        (["--x=1", "a"], "'a' after --x=1 is no flag's value"),
        (["--", "-tp", "2"], "'-tp' after -- is no flag's value"),
        (["-cc.mode"], "-cc.mode [(]a dotted JSON key[)] has no value"),
    ],
)
def test_an_argv_vllm_would_misread_is_refused(extra, error):
    with pytest.raises(ValueError, match=error):
        key(*extra)


def test_overrides_merge_over_defaults():
    """The launcher's defaults followed by server.extra_args: one group per flag, the user's,
    sorted by the flag's canonical name (`--no-enforce-eager` sorts as `--enforce-eager`)."""
    merged = server_args([*LAUNCHER, *BASE, "--enforce-eager", "--dtype=bfloat16", "--no-enforce-eager", "-tp", "2"])
    assert merged == [
        ["--dtype", "bfloat16"],
        ["--no-enforce-eager"],
        ["--max-model-len", "2048"],
        ["--model", "/verifier"],
        ["--port", "8000"],
        ["--tensor-parallel-size", "2"],
    ]


def test_run_only_flags_are_the_tables():
    assert {f for f, spec in FLAGS.items() if spec.kind == RUN_ONLY} == RUN_ONLY_FLAGS
    assert {"--model", "--port", "--gpu-memory-utilization", "--max-num-seqs"} <= RUN_ONLY_FLAGS
    assert not {"--tensor-parallel-size", "--enforce-eager", "--dtype", "--load-format"} & RUN_ONLY_FLAGS
    assert {spec.kind for spec in FLAGS.values()} == {RESULT, RUN_ONLY}


# The installed vLLM against the table: skipped where vLLM is absent.


def vllm_parser() -> argparse.ArgumentParser:
    pytest.importorskip("vllm")
    return vllm_options.vllm_parser()


def test_the_recorded_options_are_the_installed_vllms():
    """options.json (how runtime.server_args reads each option) against vLLM's own parser: an
    option vLLM adds, drops or reads otherwise is named, with the command that records it."""
    vllm_parser()
    installed = vllm_options.installed_options()
    found = vllm_options.differences(vllm_flags._RECORDED, installed)
    added, dropped, changed = found["added"], found["dropped"], found["read otherwise"]
    assert not (added or dropped or changed), (
        f"vLLM {installed['vllm_version']}'s parser against options.json (from {vllm_flags.VLLM_VERSION}): "
        f"added {added}, dropped {dropped}, read otherwise {changed}. Run `python -m devkit.vllm_options "
        "--write`, and put each added option that cannot change a result in runtime/vllm_flags/run_only.yaml, "
        "under its vLLM argument group."
    )


def test_every_run_only_option_is_one_vllm_defines():
    assert set(FLAGS) >= RUN_ONLY_OPTIONS, sorted(RUN_ONLY_OPTIONS - set(FLAGS))


def test_run_only_options_are_listed_under_their_vllm_argument_group():
    """run_only.yaml is grouped as vLLM's parser groups its options (each group's rule decides
    a new option of it): a group vLLM renames, or an option it moves, is named."""
    parser = vllm_parser()
    groups = {
        g.title: {next(s for s in a.option_strings if s.startswith("--")) for a in g._group_actions if a.option_strings}
        for g in parser._action_groups
    }
    listed = yaml.safe_load((Path(vllm_flags.__file__).parent / "run_only.yaml").read_text())
    misplaced = {group: sorted(set(flags) - groups.get(group, set())) for group, flags in listed.items()}
    assert not {group: flags for group, flags in misplaced.items() if flags}, misplaced


@pytest.mark.parametrize(
    "args",
    [
        ["--model", "/m", "-q", "fp8", "-tp", "2", "-O0", "--enforce-eager", "--seed", "-1"],
        ["--max_model_len", "4096", "--max-model", "1024", "-qfp8", "--no-enforce-eager", "-dph"],
        ["-O", "3", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}', "--api-key", "a", "b"],
        [
            "--compilation-config",
            '{"mode": 0}',
            "-cc.mode",
            "3",
            "--compilation_config.cudagraph_capture_sizes+",
            "1,2",
        ],
        ["--lora-modules", "a=/x", "--enable-lora", "--middleware", "m1", "--middleware", "m2", "--hf-token"],
        [
            "--hf-overrides.rope_theta",
            "10",
            "--kv-transfer-config",
            '{"kv_role": "kv_producer", "engine_id": "e"}',
            "-sc.method=ngram",
        ],
    ],
)
def test_the_canonical_argv_means_to_vllm_what_the_original_did(args):
    """Rewriting an argv as server_args does keeps every setting vLLM reads from it."""
    parser = vllm_parser()
    canonical = [token for group in server_args([*LAUNCHER, *args]) for token in group]
    assert vars(parser.parse_args(canonical)) == vars(parser.parse_args(args))
