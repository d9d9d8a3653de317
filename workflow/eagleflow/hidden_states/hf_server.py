"""`python -m eagleflow.hidden_states.hf_server --model DIR --port P ...`: the hf
backend's extraction server.

It loads the verifier with transformers once, for every shard job of the phase, and answers
them the way vLLM's extract_hidden_states method does (hidden_states.client): a completion
request over token ids writes each sample's states to a file named in the reply. A request
carries a batch of samples, the one forward the client's token budget made, so the states
are those the in-process forward computed (same batches, same padding). Forwards run one
at a time; /health answers once the model is loaded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import uuid
from pathlib import Path

import torch
from aiohttp import web

from eagleflow.hidden_states.client import stack_states
from eagleflow.hidden_states.forward import extract, load_verifier, resolve_compute_dtype
from eagleflow.hidden_states.storage import COMPUTE_DTYPES, torch_dtype
from eagleflow.runtime.logs import configure_logging

log = logging.getLogger("eagleflow.hf_server")


class Extractor:
    def __init__(self, model, aux_layer_ids: list[int], store_dtype: torch.dtype, storage: Path):
        self.model = model
        self.aux_layer_ids = aux_layer_ids
        self.store_dtype = store_dtype
        self.storage = storage
        self.pad_id = getattr(model.config, "pad_token_id", None) or 0
        self._one_at_a_time = asyncio.Lock()
        self.samples = 0

    def _write(self, batch: list[list[int]]) -> list[str]:
        from safetensors.torch import save_file

        samples = [{"input_ids": ids} for ids in batch]
        # One forward over the whole request: the client sized it to the token budget.
        states = extract(
            self.model,
            samples,
            self.aux_layer_ids,
            batch_tokens=max(len(ids) for ids in batch) * len(batch),
            store_dtype=self.store_dtype,
            pad_id=self.pad_id,
            progress=False,
        )
        paths = []
        for ids, (aux, final) in zip(batch, states, strict=True):
            path = self.storage / f"hf-{uuid.uuid4().hex}.safetensors"
            tmp = path.with_suffix(".tmp")
            save_file({"hidden_states": stack_states(aux, final).contiguous(), "token_ids": torch.tensor(ids)}, tmp)
            os.replace(tmp, path)  # the client never sees half a file
            paths.append(str(path))
        return paths

    async def completions(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            prompt = body["prompt"]
            batch = prompt if prompt and isinstance(prompt[0], list) else [prompt]
            if not batch or not all(ids and all(isinstance(t, int) for t in ids) for ids in batch):
                raise ValueError("prompt must be token ids, or a list of token-id lists")
        except (ValueError, KeyError, TypeError) as exc:
            return web.json_response({"error": {"message": f"bad request: {exc}"}}, status=400)
        async with self._one_at_a_time:
            paths = await asyncio.to_thread(self._write, batch)
        self.samples += len(batch)
        params = {"hidden_states_paths": paths} if isinstance(prompt[0], list) else {"hidden_states_path": paths[0]}
        choices = [{"index": i, "text": "", "finish_reason": "length"} for i in range(len(batch))]
        return web.json_response({"object": "text_completion", "choices": choices, "kv_transfer_params": params})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--aux-layer-ids", type=json.loads, required=True, help="JSON list")
    ap.add_argument("--device", required=True)
    ap.add_argument("--compute-dtype", required=True)
    ap.add_argument("--store-dtype", required=True, choices=COMPUTE_DTYPES)
    ap.add_argument("--storage-dir", required=True)
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--trust-remote-code", action="store_true")
    args = ap.parse_args(argv)
    configure_logging(sys.stderr)
    torch.set_num_threads(args.threads)
    storage = Path(args.storage_dir)
    storage.mkdir(parents=True, exist_ok=True)
    compute_dtype = resolve_compute_dtype(args.compute_dtype, args.device)
    log.info("loading %s on %s (%s)", args.model, args.device, compute_dtype)
    model = load_verifier(args.model, args.device, compute_dtype, args.trust_remote_code)
    extractor = Extractor(model, args.aux_layer_ids, torch_dtype(args.store_dtype), storage)
    app = web.Application(client_max_size=1 << 30)
    app.router.add_post("/v1/completions", extractor.completions)
    app.router.add_get("/health", extractor.health)
    log.info("serving hidden states on http://%s:%d", args.host, args.port)
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
