"""bench/gpu_check.py is run by hand on a lent GPU host; its --tiny mode runs the same code
on CPU here so that the script cannot rot between GPU sessions."""

import json
import subprocess
import sys

from tests.helpers import REPO


def test_gpu_check_script_runs_end_to_end_in_tiny_mode(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench/gpu_check.py"), "--tiny", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["failed"] == []
    for name, layer in (("training", "llama"), ("training_mla", "mla")):
        (training,) = report[name]
        assert training["finite_metrics"] and training["tokens_per_s"] > 0 and training["steps"] == 3
        assert training["attn_impl"] in ("doc_sdpa", "simple_flex_attention")
        assert training["draft_attention"] == layer and training["trainable_params_m"] > 0
    extraction = report["extraction"]
    assert extraction["plain_tokens_per_s"] > 0 and extraction["capture_tokens_per_s"] > 0
    assert extraction["capture_over_plain_time"] > 0
    # Both hidden-state backends on one shard (vLLM's extraction with eagleflow's connector):
    # float32 on CPU, the same states as transformers' to well within float32 rounding.
    backends = report["backends"]
    assert backends["hf"]["wall_s"] > 0 and backends["vllm"]["startup_s"] > 0
    assert backends["aux_rel_l2"] < 1e-5 and backends["final_rel_l2"] < 1e-5, backends
