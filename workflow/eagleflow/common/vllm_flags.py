"""Every option vLLM's OpenAI API server defines, and whether it can change what the server
computes. Pure data: keys are computed while Snakemake builds the DAG, on hosts where vLLM
may be absent or slow to import, so nothing here imports it.

The policy (docs/invalidation.md): a key holds every input that can change an output's bytes
or its numerics beyond the project's tolerance (RESULT), and nothing that only changes
capacity, placement or how the server is operated (RUN_ONLY). When it is unclear whether a
flag changes numerics it is a RESULT: a spurious recompute costs time, a wrong restore costs
correctness. common.server_args parses a server's argv with this table; a flag the table
does not know counts as a RESULT.

Made from vLLM 0.32.0's parser (vllm.entrypoints.launchers.cli_args.make_arg_parser on
a FlexibleArgumentParser), grouped as its argument groups are, in its order.
tests/unit/test_server_args.py reads the installed vLLM's parser and fails on a flag this
table does not classify, on an arity or alias that disagrees, and on a flag vLLM no longer
defines; classify new flags here by the group's rule.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

VLLM_VERSION = "0.32.0"

RESULT: Literal["result"] = "result"
RUN_ONLY: Literal["run-only"] = "run-only"

FlagClass = Literal["result", "run-only"]
# How many values argparse takes after the flag: 0 (store_true, BooleanOptionalAction), 1,
# or nargs '?', '+', '*'.
Arity = Literal[0, 1, "?", "+", "*"]


class Flag(NamedTuple):
    """One option of vLLM's server, under its canonical (first long) name."""

    kind: FlagClass
    arity: Arity
    # Its other spellings: short flags (`-tp`) and a BooleanOptionalAction's `--no-x`.
    aliases: tuple[str, ...] = ()
    # The value is JSON (vLLM parses it as a dict or list): keys compare it canonicalized.
    json: bool = False
    # argparse's `append`: every occurrence adds a value instead of replacing the last one.
    repeats: bool = False


# vLLM's argument group `options`.
# The server process itself (vllm.entrypoints.launchers.cli_args.make_arg_parser): how many
# API processes, logging, shutdown: run-only; but the kernel choices of linear-attention models.
SERVER: dict[str, Flag] = {
    "--help": Flag(RUN_ONLY, 0, ("-h",)),  # prints help; no server starts
    "--headless": Flag(RUN_ONLY, 0),
    "--api-server-count": Flag(RUN_ONLY, 1, ("-asc",)),
    "--config": Flag(RESULT, 1),  # reads more flags from a YAML file, which no key sees: server_args refuses it
    "--grpc": Flag(RUN_ONLY, 0),  # another protocol on the same engine
    "--disable-log-stats": Flag(RUN_ONLY, 0),
    "--aggregate-engine-logging": Flag(RUN_ONLY, 0),
    "--fail-on-environ-validation": Flag(RUN_ONLY, 0, ("--no-fail-on-environ-validation",)),
    "--shutdown-timeout": Flag(RUN_ONLY, 1),
    "--gdn-prefill-backend": Flag(RESULT, 1),  # kernel choice
    "--kda-prefill-backend": Flag(RESULT, 1),  # kernel choice
    "--kda-decode-backend": Flag(RESULT, 1),  # kernel choice
    "--enable-log-requests": Flag(RUN_ONLY, 0, ("--no-enable-log-requests",)),
}


# vLLM's argument group `Frontend`.
# The HTTP frontend (FrontendArgs): where it listens, who may call it, what it logs: run-only.
# What shapes a reply's content is a result: chat template, tool and reasoning parsing, roles.
# Accounting and metadata fields of a reply (usage details, timings, system_fingerprint) are
# run-only: they say how a reply was served, not what it says, and no stage reads them.
FRONTEND: dict[str, Flag] = {
    "--lora-modules": Flag(RESULT, "+", json=True),  # adapters a request can name; items are name=path or JSON
    "--chat-template": Flag(RESULT, 1),
    "--chat-template-content-format": Flag(RESULT, 1),
    # off: a request's chat_template is silently replaced by the server's
    "--trust-request-chat-template": Flag(RESULT, 0, ("--no-trust-request-chat-template",)),
    # off: such requests are refused, not answered otherwise
    "--trust-request-mm-kwargs": Flag(RUN_ONLY, 0, ("--no-trust-request-mm-kwargs",)),
    "--default-chat-template-kwargs": Flag(RESULT, 1, json=True),
    "--response-role": Flag(RESULT, 1),  # the role field of replies
    # how logprob tokens are spelled
    "--return-tokens-as-token-ids": Flag(RESULT, 0, ("--no-return-tokens-as-token-ids",)),
    "--enable-auto-tool-choice": Flag(RESULT, 0, ("--no-enable-auto-tool-choice",)),
    "--exclude-tools-when-tool-choice-none": Flag(RESULT, 0, ("--no-exclude-tools-when-tool-choice-none",)),
    "--tool-call-parser": Flag(RESULT, 1),
    "--tool-parser-plugin": Flag(RESULT, 1),
    "--tool-strict-level": Flag(RESULT, 1),
    "--tool-server": Flag(RESULT, 1),  # built-in tools whose results enter the conversation
    "--max-log-len": Flag(RUN_ONLY, 1),
    "--enable-prompt-tokens-details": Flag(RUN_ONLY, 0, ("--no-enable-prompt-tokens-details",)),  # usage accounting
    # timings, new on every run
    "--enable-per-request-metrics": Flag(RUN_ONLY, 0, ("--no-enable-per-request-metrics",)),
    "--enable-server-load-tracking": Flag(RUN_ONLY, 0, ("--no-enable-server-load-tracking",)),
    "--enable-force-include-usage": Flag(RUN_ONLY, 0, ("--no-enable-force-include-usage",)),  # usage accounting
    "--sse-keep-alive-interval": Flag(RUN_ONLY, 1),
    "--enable-tokenizer-info-endpoint": Flag(RUN_ONLY, 0, ("--no-enable-tokenizer-info-endpoint",)),
    "--enable-log-outputs": Flag(RUN_ONLY, 0, ("--no-enable-log-outputs",)),
    "--enable-log-deltas": Flag(RUN_ONLY, 0, ("--no-enable-log-deltas",)),
    "--cohere-is-reasoning-model": Flag(RESULT, 0, ("--no-cohere-is-reasoning-model",)),
    "--cohere-format": Flag(RESULT, 1),
    "--anthropic-disabled-thinking-effort": Flag(RESULT, 1),  # replies of the Anthropic endpoint
    "--log-error-stack": Flag(RUN_ONLY, 0, ("--no-log-error-stack",)),
    "--tokens-only": Flag(RUN_ONLY, 0, ("--no-tokens-only",)),  # which endpoints exist
    "--enable-scale-out": Flag(RUN_ONLY, 0, ("--no-enable-scale-out",)),  # which endpoints exist
    # system_fingerprint, an identifier no stage reads (like served-model-name in `model`)
    "--fingerprint-mode": Flag(RUN_ONLY, 1),
    "--fingerprint-value": Flag(RUN_ONLY, 1),  # system_fingerprint, an identifier no stage reads
    "--host": Flag(RUN_ONLY, 1),
    "--port": Flag(RUN_ONLY, 1),
    "--grpc-port": Flag(RUN_ONLY, 1),
    "--data-parallel-supervisor-port": Flag(RUN_ONLY, 1),
    "--dp-supervisor-probe-interval-s": Flag(RUN_ONLY, 1),
    "--dp-supervisor-probe-timeout-s": Flag(RUN_ONLY, 1),
    "--dp-supervisor-probe-failure-threshold": Flag(RUN_ONLY, 1),
    "--uds": Flag(RUN_ONLY, 1),
    "--uvicorn-log-level": Flag(RUN_ONLY, 1),
    "--disable-uvicorn-access-log": Flag(RUN_ONLY, 0, ("--no-disable-uvicorn-access-log",)),
    "--disable-access-log-for-endpoints": Flag(RUN_ONLY, 1),
    "--allow-credentials": Flag(RUN_ONLY, 0, ("--no-allow-credentials",)),
    "--allowed-origins": Flag(RUN_ONLY, 1, json=True),
    "--allowed-methods": Flag(RUN_ONLY, 1, json=True),
    "--allowed-headers": Flag(RUN_ONLY, 1, json=True),
    "--api-key": Flag(RUN_ONLY, "+"),
    "--ssl-keyfile": Flag(RUN_ONLY, 1),
    "--ssl-certfile": Flag(RUN_ONLY, 1),
    "--ssl-ca-certs": Flag(RUN_ONLY, 1),
    "--enable-ssl-refresh": Flag(RUN_ONLY, 0, ("--no-enable-ssl-refresh",)),
    "--ssl-cert-reqs": Flag(RUN_ONLY, 1),
    "--ssl-ciphers": Flag(RUN_ONLY, 1),
    "--root-path": Flag(RUN_ONLY, 1),
    "--middleware": Flag(RESULT, 1, repeats=True),  # ASGI code that can rewrite any reply
    "--enable-request-id-headers": Flag(RUN_ONLY, 0, ("--no-enable-request-id-headers",)),
    "--disable-fastapi-docs": Flag(RUN_ONLY, 0, ("--no-disable-fastapi-docs",)),
    "--h11-max-incomplete-event-size": Flag(RUN_ONLY, 1),
    "--h11-max-header-count": Flag(RUN_ONLY, 1),
    "--enable-offline-docs": Flag(RUN_ONLY, 0, ("--no-enable-offline-docs",)),
    # the fused MaxSim kernel vs the reference scorer (pooling scores)
    "--enable-flash-late-interaction": Flag(RESULT, 0, ("--no-enable-flash-late-interaction",)),
}


# vLLM's argument group `ModelConfig`.
# The model (ModelConfig): what is loaded and how it computes: result. `--model` is run-only
# because the verifier's files are keyed apart by content (common.identity.verifier_fingerprint),
# and a path must not restale; the other paths here (tokenizer, hf config) count, by value.
MODEL: dict[str, Flag] = {
    "--model": Flag(RUN_ONLY, 1),  # keyed apart by the verifier's content; a path must not restale
    "--runner": Flag(RESULT, 1),
    "--convert": Flag(RESULT, 1),
    "--tokenizer": Flag(RESULT, 1),  # a path, keyed as given (its files are not read)
    "--tokenizer-mode": Flag(RESULT, 1),
    "--trust-remote-code": Flag(RESULT, 0, ("--no-trust-remote-code",)),
    "--dtype": Flag(RESULT, 1),
    "--seed": Flag(RESULT, 1),
    "--hf-config-path": Flag(RESULT, 1),  # a path, keyed as given
    # a permission: a refused request fails, it is not answered otherwise
    "--allowed-local-media-path": Flag(RUN_ONLY, 1),
    "--allowed-media-domains": Flag(RUN_ONLY, "+"),  # a permission
    "--revision": Flag(RESULT, 1),
    "--code-revision": Flag(RESULT, 1),
    "--tokenizer-revision": Flag(RESULT, 1),
    "--max-model-len": Flag(RESULT, 1),
    "--quantization": Flag(RESULT, 1, ("-q",)),
    "--quantization-config": Flag(RESULT, 1, json=True),
    # a permission, but it lets a quantization load that otherwise would not
    "--allow-deprecated-quantization": Flag(RESULT, 0, ("--no-allow-deprecated-quantization",)),
    "--enforce-eager": Flag(RESULT, 0, ("--no-enforce-eager",)),  # eager kernels instead of compiled, fused ones
    "--enable-return-routed-experts": Flag(RESULT, 0, ("--no-enable-return-routed-experts",)),  # a field of the output
    "--return-sampling-mask": Flag(RESULT, 0, ("--no-return-sampling-mask",)),  # a field of the output
    "--max-logprobs": Flag(RESULT, 1),  # caps the logprobs a reply holds
    "--logprobs-mode": Flag(RESULT, 1),
    "--use-fp64-gumbel": Flag(RESULT, 0, ("--no-use-fp64-gumbel",)),
    "--enable-trace-replay": Flag(RESULT, 0, ("--no-enable-trace-replay",)),  # lets requests force decoded tokens
    "--disable-sliding-window": Flag(RESULT, 0, ("--no-disable-sliding-window",)),
    # a no-op in 0.32; it chose attention kernels where cascade attention existed
    "--disable-cascade-attn": Flag(RESULT, 0, ("--no-disable-cascade-attn",)),
    "--skip-tokenizer-init": Flag(RESULT, 0, ("--no-skip-tokenizer-init",)),  # replies without detokenized text
    # a permission, but it moves the embedding lookup out of the compiled graph
    "--enable-prompt-embeds": Flag(RESULT, 0, ("--no-enable-prompt-embeds",)),
    "--served-model-name": Flag(RUN_ONLY, "+"),  # the name requests use; the request payload, keyed apart, holds it
    "--config-format": Flag(RESULT, 1),
    "--hf-token": Flag(RUN_ONLY, "?"),  # a credential
    "--hf-overrides": Flag(RESULT, 1, json=True),
    "--model-class-overrides": Flag(RESULT, 1, json=True),
    "--pooler-config": Flag(RESULT, 1, json=True),
    "--generation-config": Flag(RESULT, 1),
    "--override-generation-config": Flag(RESULT, 1, json=True),
    "--enable-sleep-mode": Flag(RUN_ONLY, 0, ("--no-enable-sleep-mode",)),  # memory management
    "--sleep-mode-offload-cudagraph": Flag(RUN_ONLY, 0, ("--no-sleep-mode-offload-cudagraph",)),
    "--sleep-preserve-parameter-names": Flag(RUN_ONLY, "+"),
    "--enable-cumem-allocator": Flag(RUN_ONLY, 0, ("--no-enable-cumem-allocator",)),  # memory management
    "--enable-nccl-comm-suspend": Flag(RUN_ONLY, 0, ("--no-enable-nccl-comm-suspend",)),
    "--model-impl": Flag(RESULT, 1),
    "--logits-processors": Flag(RESULT, "+"),  # code on the logits
    "--io-processor-plugin": Flag(RESULT, 1),
    "--renderer-num-workers": Flag(RUN_ONLY, 1),
}


# vLLM's argument group `LoadConfig`.
# How weights are read (LoadConfig): I/O is run-only, what is read (format, patterns) a result.
LOAD: dict[str, Flag] = {
    "--load-format": Flag(RESULT, 1),  # `dummy` loads random weights
    "--download-dir": Flag(RUN_ONLY, 1),
    "--safetensors-load-strategy": Flag(RESULT, 1),  # I/O, but `torchao` rebuilds the weights as torchao tensors
    "--safetensors-prefetch-num-threads": Flag(RUN_ONLY, 1),
    "--safetensors-prefetch-block-size": Flag(RUN_ONLY, 1),
    "--model-loader-extra-config": Flag(RESULT, 1, json=True),  # the loader's options can change what is loaded
    "--ignore-patterns": Flag(RESULT, "+"),  # which weight files are read
    "--use-tqdm-on-load": Flag(RUN_ONLY, 0, ("--no-use-tqdm-on-load",)),
    "--pt-load-map-location": Flag(RUN_ONLY, 1, json=True),  # where .pt weights land while loading; the same values
}


# vLLM's argument group `AttentionConfig`.
# The attention kernels: result.
ATTENTION: dict[str, Flag] = {
    "--attention-backend": Flag(RESULT, 1),
}


# vLLM's argument group `MambaConfig`.
# State-space layers' kernels and rounding: result.
MAMBA: dict[str, Flag] = {
    "--mamba-backend": Flag(RESULT, 1),
    "--mamba-ssu-algorithm": Flag(RESULT, 1),
    "--enable-mamba-cache-stochastic-rounding": Flag(RESULT, 0, ("--no-enable-mamba-cache-stochastic-rounding",)),
    "--mamba-cache-philox-rounds": Flag(RESULT, 1),
}


# vLLM's argument group `StructuredOutputsConfig`.
# Reasoning parsing splits a reply into its fields: result.
STRUCTURED_OUTPUTS: dict[str, Flag] = {
    "--reasoning-parser": Flag(RESULT, 1),
    "--reasoning-parser-plugin": Flag(RESULT, 1),
}


# vLLM's argument group `ParallelConfig`.
# Parallelism (ParallelConfig): the sizes and the collectives change reduction order: result.
# Where the same ranks run (addresses, ports, ranks, NUMA, executor, load balancing): run-only.
PARALLEL: dict[str, Flag] = {
    "--distributed-executor-backend": Flag(RUN_ONLY, 1),  # mp, ray, uni: how ranks are started
    # splits layers over ranks: other kernels and batch shapes per stage
    "--pipeline-parallel-size": Flag(RESULT, 1, ("-pp",)),
    "--master-addr": Flag(RUN_ONLY, 1),
    "--master-port": Flag(RUN_ONLY, 1),
    # the same sizes over more nodes take other collectives (NCCL across nodes, no custom all-reduce)
    "--nnodes": Flag(RESULT, 1, ("-n",)),
    "--node-rank": Flag(RUN_ONLY, 1, ("-r",)),  # which node this one is
    "--distributed-timeout-seconds": Flag(RUN_ONLY, 1),
    "--cpu-distributed-timeout-seconds": Flag(RUN_ONLY, 1),
    "--numa-bind": Flag(RUN_ONLY, 0, ("--no-numa-bind",)),
    "--numa-bind-nodes": Flag(RUN_ONLY, "+"),
    "--numa-bind-cpus": Flag(RUN_ONLY, "+"),
    "--device-ids": Flag(RUN_ONLY, 1),  # which GPUs; their model is in every key's stack
    "--tensor-parallel-size": Flag(RESULT, 1, ("-tp",)),
    "--decode-context-parallel-size": Flag(RESULT, 1, ("-dcp",)),
    "--dcp-comm-backend": Flag(RESULT, 1),
    "--dcp-q-replicate": Flag(RESULT, 0, ("--no-dcp-q-replicate",)),
    "--dcp-kv-cache-interleave-size": Flag(RESULT, 1),
    "--cp-kv-cache-interleave-size": Flag(RESULT, 1),
    "--prefill-context-parallel-size": Flag(RESULT, 1, ("-pcp",)),
    "--data-parallel-size": Flag(RESULT, 1, ("-dp",)),  # replicas; with MoE they share experts (EP, all2all)
    "--data-parallel-rank": Flag(RUN_ONLY, 1, ("-dpn",)),
    "--data-parallel-start-rank": Flag(RUN_ONLY, 1, ("-dpr",)),
    "--data-parallel-size-local": Flag(RUN_ONLY, 1, ("-dpl",)),  # how many of the replicas run on this node
    "--data-parallel-address": Flag(RUN_ONLY, 1, ("-dpa",)),
    "--data-parallel-rpc-port": Flag(RUN_ONLY, 1, ("-dpp",)),
    "--data-parallel-backend": Flag(RUN_ONLY, 1, ("-dpb",)),
    "--data-parallel-hybrid-lb": Flag(RUN_ONLY, 0, ("--no-data-parallel-hybrid-lb", "-dph")),
    "--data-parallel-external-lb": Flag(RUN_ONLY, 0, ("--no-data-parallel-external-lb", "-dpe")),
    "--data-parallel-multi-port-external-lb": Flag(RUN_ONLY, 0, ("-dpm",)),
    "--enable-hc-sp": Flag(RESULT, 0, ("--no-enable-hc-sp",)),
    "--enable-expert-parallel": Flag(RESULT, 0, ("--no-enable-expert-parallel", "-ep")),
    # sampling split over TP ranks
    "--enable-batch-sharded-sampling": Flag(RESULT, 0, ("--no-enable-batch-sharded-sampling",)),
    # each rank reads only its experts' files; the same weights
    "--enable-ep-weight-filter": Flag(RUN_ONLY, 0, ("--no-enable-ep-weight-filter",)),
    "--all2all-backend": Flag(RESULT, 1),
    # micro-batches overlapped with MoE communication: other kernels
    "--enable-dbo": Flag(RESULT, 0, ("--no-enable-dbo",)),
    "--enable-shm-tensor-arena": Flag(RUN_ONLY, 0, ("--no-enable-shm-tensor-arena",)),
    "--ubatch-size": Flag(RESULT, 1),  # micro-batching (dual batch overlap)
    "--enable-elastic-ep": Flag(RESULT, 0, ("--no-enable-elastic-ep",)),  # EP and DP sizes that change while serving
    "--elastic-ep-max-dp-size": Flag(RESULT, 1),  # EP and DP sizes that change while serving
    "--dbo-decode-token-threshold": Flag(RESULT, 1),  # when micro-batching starts (dual batch overlap)
    "--dp-sync-interval": Flag(RUN_ONLY, 1),
    "--dbo-prefill-token-threshold": Flag(RESULT, 1),  # when micro-batching starts (dual batch overlap)
    "--disable-nccl-for-dp-synchronization": Flag(RUN_ONLY, 0, ("--no-disable-nccl-for-dp-synchronization",)),
    "--enable-eplb": Flag(RESULT, 0, ("--no-enable-eplb",)),  # experts replicated and moved between ranks
    "--eplb-config": Flag(RESULT, 1, json=True),
    "--expert-placement-strategy": Flag(RESULT, 1),  # which rank holds which expert
    "--max-parallel-loading-workers": Flag(RUN_ONLY, 1),
    "--ray-workers-use-nsight": Flag(RUN_ONLY, 0, ("--no-ray-workers-use-nsight",)),
    # NCCL's all-reduce instead of vLLM's: another reduction order
    "--disable-custom-all-reduce": Flag(RESULT, 0, ("--no-disable-custom-all-reduce",)),
    "--worker-cls": Flag(RESULT, 1),  # code in every rank
    "--worker-extension-cls": Flag(RESULT, 1),  # code in every rank (it can replace weights)
    "--enable-fault-tolerance": Flag(RUN_ONLY, 0, ("--no-enable-fault-tolerance",)),
    "--fault-tolerance-config": Flag(RUN_ONLY, 1, json=True),  # how a failed rank is handled
}


# vLLM's argument group `CacheConfig`.
# The KV cache (CacheConfig): its dtype and kernels are results, its size is capacity.
# Prefix caching is run-only: a hit reuses KV the same model computed for the same tokens, in
# another batch, which is the batch-composition variance concurrent requests already have (within
# tolerance); the extraction server turns it off itself, after the user's flags.
CACHE: dict[str, Flag] = {
    "--block-size": Flag(RESULT, 1),  # the paged-attention kernels' tiling and split-KV partitions follow it
    "--gpu-memory-utilization": Flag(RUN_ONLY, 1, ("--device-memory-utilization",)),  # capacity
    "--kv-cache-memory-bytes": Flag(RUN_ONLY, 1),  # capacity
    "--kv-cache-dtype": Flag(RESULT, 1),
    "--num-gpu-blocks-override": Flag(RUN_ONLY, 1),  # capacity
    "--enable-prefix-caching": Flag(RUN_ONLY, 0, ("--no-enable-prefix-caching",)),  # see the group's comment
    "--prefix-caching-hash-algo": Flag(RUN_ONLY, 1),  # how prefix-cache keys are hashed
    "--prefix-cache-retention-interval": Flag(RUN_ONLY, 1),
    "--kv-cache-dtype-skip-layers": Flag(RESULT, "+"),  # layers that keep full-precision KV
    # layers skip prefill tokens (YOCO)
    "--kv-sharing-fast-prefill": Flag(RESULT, 0, ("--no-kv-sharing-fast-prefill",)),
    # recomputes the sliding window after a prefix hit, in eager steps
    "--swa-bounded-replay": Flag(RESULT, 0, ("--no-swa-bounded-replay",)),
    "--mamba-cache-dtype": Flag(RESULT, 1),
    "--mamba-ssm-cache-dtype": Flag(RESULT, 1),
    "--mamba-block-size": Flag(RESULT, 1),  # the chunk size of state-space kernels
    "--prefix-match-unit": Flag(RUN_ONLY, 1),  # prefix-cache granularity
    "--mamba-cache-mode": Flag(RESULT, 1),  # how state-space caches are checkpointed; other kernels
    "--enable-mamba-shared-prefix-checkpoint": Flag(RESULT, 0, ("--no-enable-mamba-shared-prefix-checkpoint",)),
    "--replayssm-buffer-len": Flag(RESULT, 1),
    "--use-replayssm": Flag(RESULT, 0, ("--no-use-replayssm",)),
    "--kv-offloading-size": Flag(RUN_ONLY, 1),  # capacity: KV blocks kept in CPU memory, byte for byte
    "--kv-offloading-backend": Flag(RUN_ONLY, 1),  # where offloaded KV blocks are kept
}


# vLLM's argument group `OffloadConfig`.
# Weight offloading to CPU memory moves the same values: run-only.
OFFLOAD: dict[str, Flag] = {
    "--offload-backend": Flag(RUN_ONLY, 1),
    "--cpu-offload-gb": Flag(RUN_ONLY, 1),
    "--cpu-offload-params": Flag(RUN_ONLY, "+"),
    "--offload-group-size": Flag(RUN_ONLY, 1),
    "--offload-num-in-group": Flag(RUN_ONLY, 1),
    "--offload-prefetch-step": Flag(RUN_ONLY, 1),
    "--offload-params": Flag(RUN_ONLY, "+"),
}


# vLLM's argument group `MultiModalConfig`.
# Multimodal inputs: how media is processed and encoded is a result, caches and IPC run-only.
MULTIMODAL: dict[str, Flag] = {
    "--language-model-only": Flag(RESULT, 0, ("--no-language-model-only",)),  # skips the multimodal towers
    "--limit-mm-per-prompt": Flag(RESULT, 1, json=True),  # a limit, but 0 skips loading and profiling an encoder
    "--enable-mm-embeds": Flag(RESULT, 0, ("--no-enable-mm-embeds",)),  # a permission; kept with --enable-prompt-embeds
    "--media-io-kwargs": Flag(RESULT, 1, json=True),
    "--mm-processor-kwargs": Flag(RESULT, 1, json=True),
    "--mm-processor-cache-gb": Flag(RUN_ONLY, 1),
    "--mm-processor-cache-type": Flag(RUN_ONLY, 1),
    "--mm-hasher-algorithm": Flag(RUN_ONLY, 1),
    "--mm-shm-cache-max-object-size-mb": Flag(RUN_ONLY, 1),
    "--mm-encoder-only": Flag(RESULT, 0, ("--no-mm-encoder-only",)),
    "--mm-encoder-tp-mode": Flag(RESULT, 1),  # how the encoder is sharded: reduction order
    "--mm-encoder-attn-backend": Flag(RESULT, 1),
    "--mm-encoder-attn-dtype": Flag(RESULT, 1),
    "--mm-encoder-fp8-scale-path": Flag(RESULT, 1),
    "--mm-encoder-fp8-scale-save-path": Flag(RESULT, 1),  # calibration of the fp8 encoder scales
    "--mm-encoder-fp8-scale-save-margin": Flag(RESULT, 1),  # calibration of the fp8 encoder scales
    "--interleave-mm-strings": Flag(RESULT, 0, ("--no-interleave-mm-strings",)),
    "--skip-mm-profiling": Flag(RUN_ONLY, 0, ("--no-skip-mm-profiling",)),  # memory profiling at startup
    "--video-pruning-rate": Flag(RESULT, 1),
    "--video-pruning-method": Flag(RESULT, 1),
    "--mm-tensor-ipc": Flag(RUN_ONLY, 1),
    "--mm-processor-device": Flag(RESULT, 1),  # preprocessing on the GPU rounds differently
    "--mm-ipc-gpu-memory-gb": Flag(RUN_ONLY, 1),
    "--mm-device-do-normalize": Flag(RESULT, 0, ("--no-mm-device-do-normalize",)),
}


# vLLM's argument group `LoRAConfig`.
# LoRA adapters change the weights a request runs with: result, but capacities.
LORA: dict[str, Flag] = {
    "--enable-lora": Flag(RESULT, 0, ("--no-enable-lora",)),
    "--max-loras": Flag(RUN_ONLY, 1),  # capacity: adapters per batch
    "--max-lora-rank": Flag(RESULT, 1),  # adapters are padded to it: other kernel shapes
    "--lora-dtype": Flag(RESULT, 1),
    "--enable-tower-connector-lora": Flag(RESULT, 0, ("--no-enable-tower-connector-lora",)),
    "--max-cpu-loras": Flag(RUN_ONLY, 1),  # capacity: adapters kept in CPU memory
    "--fully-sharded-loras": Flag(RESULT, 0, ("--no-fully-sharded-loras",)),
    "--lora-target-modules": Flag(RESULT, "+"),
    "--default-mm-loras": Flag(RESULT, 1, json=True),
    # other CUDA graphs and LoRA kernel grids
    "--specialize-active-lora": Flag(RESULT, 0, ("--no-specialize-active-lora",)),
    "--enable-mixed-moe-lora-format": Flag(RESULT, 0, ("--no-enable-mixed-moe-lora-format",)),
    "--enable-moe-shared-loras": Flag(RESULT, 0, ("--no-enable-moe-shared-loras",)),
    "--max-lora-cls-labels": Flag(RESULT, 1),  # the size of LoRA classification heads
}


# vLLM's argument group `LoggingConfig`.
# Logging: run-only.
LOGGING: dict[str, Flag] = {
    "--logging-config": Flag(RUN_ONLY, 1, json=True),
    "--log-level": Flag(RUN_ONLY, 1),
    "--log-config-file": Flag(RUN_ONLY, 1),
}


# vLLM's argument group `ObservabilityConfig`.
# Metrics and tracing: run-only.
OBSERVABILITY: dict[str, Flag] = {
    "--show-hidden-metrics-for-version": Flag(RUN_ONLY, 1),
    "--otlp-traces-endpoint": Flag(RUN_ONLY, 1),
    "--collect-detailed-traces": Flag(RUN_ONLY, "+"),
    "--per-request-spec-decode-metrics": Flag(RUN_ONLY, 1),  # acceptance metrics in the reply, which no stage reads
    "--kv-cache-metrics": Flag(RUN_ONLY, 0, ("--no-kv-cache-metrics",)),
    "--kv-cache-metrics-sample": Flag(RUN_ONLY, 1),
    "--custom-histogram-buckets": Flag(RUN_ONLY, 1, json=True),
    "--cudagraph-metrics": Flag(RUN_ONLY, 0, ("--no-cudagraph-metrics",)),
    # tracing, but it does not work with CUDA graphs (other execution)
    "--enable-layerwise-nvtx-tracing": Flag(RESULT, 0, ("--no-enable-layerwise-nvtx-tracing",)),
    "--enable-mfu-metrics": Flag(RUN_ONLY, 0, ("--no-enable-mfu-metrics",)),
    "--enable-logging-iteration-details": Flag(RUN_ONLY, 0, ("--no-enable-logging-iteration-details",)),
    "--jit-monitor-mode": Flag(RUN_ONLY, 1),  # warns or fails on runtime JIT compilation
    "--jit-monitor-verbose": Flag(RUN_ONLY, 0, ("--no-jit-monitor-verbose",)),
}


# vLLM's argument group `SchedulerConfig`.
# Scheduling (SchedulerConfig): capacity and order. Batch composition (how many sequences and
# tokens share a step, chunked prefill) already varies between runs under concurrent requests and
# stays within tolerance: run-only. A custom scheduler class is code: result.
SCHEDULER: dict[str, Flag] = {
    "--max-num-batched-tokens": Flag(RUN_ONLY, 1),  # capacity (also the chunked-prefill chunk size)
    "--max-num-scheduled-tokens": Flag(RUN_ONLY, 1),
    "--max-num-seqs": Flag(RUN_ONLY, 1),  # capacity
    "--max-num-active-seqs": Flag(RUN_ONLY, 1),
    "--max-num-queued-reqs": Flag(RUN_ONLY, 1),
    "--max-num-queued-tokens": Flag(RUN_ONLY, 1),
    "--long-prefill-token-threshold": Flag(RUN_ONLY, 1),
    "--long-prefill-token-threshold-adaptive": Flag(RUN_ONLY, 0, ("--no-long-prefill-token-threshold-adaptive",)),
    "--scheduling-policy": Flag(RUN_ONLY, 1),
    "--enable-chunked-prefill": Flag(RUN_ONLY, 0, ("--no-enable-chunked-prefill",)),  # batch composition
    "--disable-chunked-mm-input": Flag(RUN_ONLY, 0, ("--no-disable-chunked-mm-input",)),
    "--scheduler-cls": Flag(RESULT, 1),  # code that schedules
    "--scheduler-reserve-full-isl": Flag(RUN_ONLY, 0, ("--no-scheduler-reserve-full-isl",)),
    "--watermark": Flag(RUN_ONLY, 1),  # free KV blocks kept when admitting requests (not --watermark-config)
    "--prefill-schedule-interval": Flag(RUN_ONLY, 1),
    # KV memory for sliding-window layers; the same attention
    "--disable-hybrid-kv-cache-manager": Flag(RUN_ONLY, 0, ("--no-disable-hybrid-kv-cache-manager",)),
    # schedules step n+1 while step n runs; the same tokens
    "--async-scheduling": Flag(RUN_ONLY, 0, ("--no-async-scheduling",)),
    "--stream-interval": Flag(RUN_ONLY, 1),  # how streamed tokens are chunked
}


# vLLM's argument group `CompilationConfig`.
# CUDA graph capture: part of the compilation config that -O and -cc set: result.
COMPILATION: dict[str, Flag] = {
    "--cudagraph-capture-sizes": Flag(RESULT, "+"),  # batch sizes padded to captured graphs
    "--max-cudagraph-capture-size": Flag(RESULT, 1),
}


# vLLM's argument group `KernelConfig`.
# Kernel selection: result.
KERNEL: dict[str, Flag] = {
    "--ir-op-priority": Flag(RESULT, 1, json=True),
    "--enable-flashinfer-autotune": Flag(RESULT, 0, ("--no-enable-flashinfer-autotune",)),
    "--moe-backend": Flag(RESULT, 1),
    "--linear-backend": Flag(RESULT, 1),
    "--sparse-indexer-topk-backend": Flag(RESULT, 1),
}


# vLLM's argument group `VllmConfig`.
# Engine-wide configs (VllmConfig): speculative decoding, compilation (-O, -cc), kernels, KV
# transfer (the hidden-state extraction's connector): result; event publishing and profiling run-only.
ENGINE: dict[str, Flag] = {
    "--speculative-config": Flag(RESULT, 1, ("-sc",), json=True),  # the extraction method and the benchmark's draft
    "--spec-method": Flag(RESULT, 1),
    "--spec-model": Flag(RESULT, 1),
    "--spec-tokens": Flag(RESULT, 1),
    "--watermark-config": Flag(RESULT, 1, json=True),  # text watermarking changes sampling
    "--diffusion-config": Flag(RESULT, 1, ("-dc",), json=True),
    "--kv-transfer-config": Flag(RESULT, 1, json=True),  # the hidden-state extraction's connector; KV from elsewhere
    "--kv-events-config": Flag(RUN_ONLY, 1, json=True),  # publishes KV cache events
    "--ec-transfer-config": Flag(RESULT, 1, json=True),  # encoder outputs from another instance
    "--ec-manager-config": Flag(RESULT, 1, json=True),  # a custom encoder cache manager (code)
    "--compilation-config": Flag(RESULT, 1, ("-cc",), json=True),
    "--attention-config": Flag(RESULT, 1, ("-ac",), json=True),
    "--engram-config": Flag(RESULT, 1, json=True),  # n-gram embeddings and how they are sharded
    "--reasoning-config": Flag(RESULT, 1, json=True),
    "--kernel-config": Flag(RESULT, 1, json=True),
    "--additional-config": Flag(RESULT, 1, json=True),  # platform-specific, opaque
    "--structured-outputs-config": Flag(RESULT, 1, json=True),  # the guided-decoding backend
    "--aux-output-config": Flag(RESULT, 1, json=True),  # auxiliary outputs (routed experts) in the output
    "--profiler-config": Flag(RUN_ONLY, 1, json=True),  # profiling
    # -O0 .. -O3 (FlexibleArgumentParser rewrites -ON): which compilation and fusions
    "--optimization-level": Flag(RESULT, 1),
    "--performance-mode": Flag(RESULT, 1),  # picks kernels and CUDA graph sizes
    "--weight-transfer-config": Flag(RESULT, 1, json=True),  # weights replaced at runtime (RL)
}

# Every option, by its canonical (first long) name.
FLAGS: dict[str, Flag] = {
    **SERVER,
    **FRONTEND,
    **MODEL,
    **LOAD,
    **ATTENTION,
    **MAMBA,
    **STRUCTURED_OUTPUTS,
    **PARALLEL,
    **CACHE,
    **OFFLOAD,
    **MULTIMODAL,
    **LORA,
    **LOGGING,
    **OBSERVABILITY,
    **SCHEDULER,
    **COMPILATION,
    **KERNEL,
    **ENGINE,
}
