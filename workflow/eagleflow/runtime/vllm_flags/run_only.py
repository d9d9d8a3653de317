"""The vLLM server options that cannot change what the server computes: run-only, by
eagleflow's judgement (docs/invalidation.md: a key holds every input that can change an
output's bytes or its numerics beyond the project's tolerance, and nothing that only changes
capacity, placement or how the server is operated). Every other option vLLM defines
(options.json, read from its own parser) counts as a result, and so does one this list and
options.json do not know: a spurious recompute costs time, a wrong restore correctness.

Grouped as vLLM's argument groups are, each with the group's rule; classify a new option
of a group by it (tests/unit/test_server_args.py names the options a new vLLM adds).
"""

from __future__ import annotations

# vLLM's argument group `options`.
# The server process itself (vllm.entrypoints.launchers.cli_args.make_arg_parser): how many
# API processes, logging, shutdown: run-only; but the kernel choices of linear-attention models.
SERVER = frozenset(
    {
        "--help",  # prints help; no server starts
        "--headless",
        "--api-server-count",
        "--grpc",  # another protocol on the same engine
        "--disable-log-stats",
        "--aggregate-engine-logging",
        "--fail-on-environ-validation",
        "--shutdown-timeout",
        "--enable-log-requests",
    }
)

# vLLM's argument group `Frontend`.
# The HTTP frontend (FrontendArgs): where it listens, who may call it, what it logs: run-only.
# What shapes a reply's content is a result: chat template, tool and reasoning parsing, roles.
# Accounting and metadata fields of a reply (usage details, timings, system_fingerprint) are
# run-only: they say how a reply was served, not what it says, and no stage reads them.
FRONTEND = frozenset(
    {
        # off: such requests are refused, not answered otherwise
        "--trust-request-mm-kwargs",
        "--max-log-len",
        "--enable-prompt-tokens-details",  # usage accounting
        # timings, new on every run
        "--enable-per-request-metrics",
        "--enable-server-load-tracking",
        "--enable-force-include-usage",  # usage accounting
        "--sse-keep-alive-interval",
        "--enable-tokenizer-info-endpoint",
        "--enable-log-outputs",
        "--enable-log-deltas",
        "--log-error-stack",
        "--tokens-only",  # which endpoints exist
        "--enable-scale-out",  # which endpoints exist
        # system_fingerprint, an identifier no stage reads (like served-model-name in `model`)
        "--fingerprint-mode",
        "--fingerprint-value",  # system_fingerprint, an identifier no stage reads
        "--host",
        "--port",
        "--grpc-port",
        "--data-parallel-supervisor-port",
        "--dp-supervisor-probe-interval-s",
        "--dp-supervisor-probe-timeout-s",
        "--dp-supervisor-probe-failure-threshold",
        "--uds",
        "--uvicorn-log-level",
        "--disable-uvicorn-access-log",
        "--disable-access-log-for-endpoints",
        "--allow-credentials",
        "--allowed-origins",
        "--allowed-methods",
        "--allowed-headers",
        "--api-key",
        "--ssl-keyfile",
        "--ssl-certfile",
        "--ssl-ca-certs",
        "--enable-ssl-refresh",
        "--ssl-cert-reqs",
        "--ssl-ciphers",
        "--root-path",
        "--enable-request-id-headers",
        "--disable-fastapi-docs",
        "--h11-max-incomplete-event-size",
        "--h11-max-header-count",
        "--enable-offline-docs",
    }
)

# vLLM's argument group `ModelConfig`.
# The model (ModelConfig): what is loaded and how it computes: result. `--model` is run-only
# because the verifier's files are keyed apart by content (common.identity.verifier_fingerprint),
# and a path must not restale; the other paths here (tokenizer, hf config) count, by value.
MODEL = frozenset(
    {
        "--model",  # keyed apart by the verifier's content; a path must not restale
        # a permission: a refused request fails, it is not answered otherwise
        "--allowed-local-media-path",
        "--allowed-media-domains",  # a permission
        "--served-model-name",  # the name requests use; the request payload, keyed apart, holds it
        "--hf-token",  # a credential
        "--enable-sleep-mode",  # memory management
        "--sleep-mode-offload-cudagraph",
        "--sleep-preserve-parameter-names",
        "--enable-cumem-allocator",  # memory management
        "--enable-nccl-comm-suspend",
        "--renderer-num-workers",
    }
)

# vLLM's argument group `LoadConfig`.
# How weights are read (LoadConfig): I/O is run-only, what is read (format, patterns) a result.
LOAD = frozenset(
    {
        "--download-dir",
        "--safetensors-prefetch-num-threads",
        "--safetensors-prefetch-block-size",
        "--use-tqdm-on-load",
        "--pt-load-map-location",  # where .pt weights land while loading; the same values
    }
)

# vLLM's argument group `AttentionConfig`.
# The attention kernels: result.
ATTENTION = frozenset({})

# vLLM's argument group `MambaConfig`.
# State-space layers' kernels and rounding: result.
MAMBA = frozenset({})

# vLLM's argument group `StructuredOutputsConfig`.
# Reasoning parsing splits a reply into its fields: result.
STRUCTURED_OUTPUTS = frozenset({})

# vLLM's argument group `ParallelConfig`.
# Parallelism (ParallelConfig): the sizes and the collectives change reduction order: result.
# Where the same ranks run (addresses, ports, ranks, NUMA, executor, load balancing): run-only.
PARALLEL = frozenset(
    {
        "--distributed-executor-backend",  # mp, ray, uni: how ranks are started
        "--master-addr",
        "--master-port",
        "--node-rank",  # which node this one is
        "--distributed-timeout-seconds",
        "--cpu-distributed-timeout-seconds",
        "--numa-bind",
        "--numa-bind-nodes",
        "--numa-bind-cpus",
        "--device-ids",  # which GPUs; their model is in every key's stack
        "--data-parallel-rank",
        "--data-parallel-start-rank",
        "--data-parallel-size-local",  # how many of the replicas run on this node
        "--data-parallel-address",
        "--data-parallel-rpc-port",
        "--data-parallel-backend",
        "--data-parallel-hybrid-lb",
        "--data-parallel-external-lb",
        "--data-parallel-multi-port-external-lb",
        # each rank reads only its experts' files; the same weights
        "--enable-ep-weight-filter",
        "--enable-shm-tensor-arena",
        "--dp-sync-interval",
        "--disable-nccl-for-dp-synchronization",
        "--max-parallel-loading-workers",
        "--ray-workers-use-nsight",
        "--enable-fault-tolerance",
        "--fault-tolerance-config",  # how a failed rank is handled
    }
)

# vLLM's argument group `CacheConfig`.
# The KV cache (CacheConfig): its dtype and kernels are results, its size is capacity.
# Prefix caching is run-only: a hit reuses KV the same model computed for the same tokens, in
# another batch, which is the batch-composition variance concurrent requests already have (within
# tolerance); the extraction server turns it off itself, after the user's flags.
CACHE = frozenset(
    {
        "--gpu-memory-utilization",  # capacity
        "--kv-cache-memory-bytes",  # capacity
        "--num-gpu-blocks-override",  # capacity
        "--enable-prefix-caching",  # see the group's comment
        "--prefix-caching-hash-algo",  # how prefix-cache keys are hashed
        "--prefix-cache-retention-interval",
        "--prefix-match-unit",  # prefix-cache granularity
        "--kv-offloading-size",  # capacity: KV blocks kept in CPU memory, byte for byte
        "--kv-offloading-backend",  # where offloaded KV blocks are kept
    }
)

# vLLM's argument group `OffloadConfig`.
# Weight offloading to CPU memory moves the same values: run-only.
OFFLOAD = frozenset(
    {
        "--offload-backend",
        "--cpu-offload-gb",
        "--cpu-offload-params",
        "--offload-group-size",
        "--offload-num-in-group",
        "--offload-prefetch-step",
        "--offload-params",
    }
)

# vLLM's argument group `MultiModalConfig`.
# Multimodal inputs: how media is processed and encoded is a result, caches and IPC run-only.
MULTIMODAL = frozenset(
    {
        "--mm-processor-cache-gb",
        "--mm-processor-cache-type",
        "--mm-hasher-algorithm",
        "--mm-shm-cache-max-object-size-mb",
        "--skip-mm-profiling",  # memory profiling at startup
        "--mm-tensor-ipc",
        "--mm-ipc-gpu-memory-gb",
    }
)

# vLLM's argument group `LoRAConfig`.
# LoRA adapters change the weights a request runs with: result, but capacities.
LORA = frozenset(
    {
        "--max-loras",  # capacity: adapters per batch
        "--max-cpu-loras",  # capacity: adapters kept in CPU memory
    }
)

# vLLM's argument group `LoggingConfig`.
# Logging: run-only.
LOGGING = frozenset(
    {
        "--logging-config",
        "--log-level",
        "--log-config-file",
    }
)

# vLLM's argument group `ObservabilityConfig`.
# Metrics and tracing: run-only.
OBSERVABILITY = frozenset(
    {
        "--show-hidden-metrics-for-version",
        "--otlp-traces-endpoint",
        "--collect-detailed-traces",
        "--per-request-spec-decode-metrics",  # acceptance metrics in the reply, which no stage reads
        "--kv-cache-metrics",
        "--kv-cache-metrics-sample",
        "--custom-histogram-buckets",
        "--cudagraph-metrics",
        "--enable-mfu-metrics",
        "--enable-logging-iteration-details",
        "--jit-monitor-mode",  # warns or fails on runtime JIT compilation
        "--jit-monitor-verbose",
    }
)

# vLLM's argument group `SchedulerConfig`.
# Scheduling (SchedulerConfig): capacity and order. Batch composition (how many sequences and
# tokens share a step, chunked prefill) already varies between runs under concurrent requests and
# stays within tolerance: run-only. A custom scheduler class is code: result.
SCHEDULER = frozenset(
    {
        "--max-num-batched-tokens",  # capacity (also the chunked-prefill chunk size)
        "--max-num-scheduled-tokens",
        "--max-num-seqs",  # capacity
        "--max-num-active-seqs",
        "--max-num-queued-reqs",
        "--max-num-queued-tokens",
        "--long-prefill-token-threshold",
        "--long-prefill-token-threshold-adaptive",
        "--scheduling-policy",
        "--enable-chunked-prefill",  # batch composition
        "--disable-chunked-mm-input",
        "--scheduler-reserve-full-isl",
        "--watermark",  # free KV blocks kept when admitting requests (not --watermark-config)
        "--prefill-schedule-interval",
        # KV memory for sliding-window layers; the same attention
        "--disable-hybrid-kv-cache-manager",
        # schedules step n+1 while step n runs; the same tokens
        "--async-scheduling",
        "--stream-interval",  # how streamed tokens are chunked
    }
)

# vLLM's argument group `CompilationConfig`.
# CUDA graph capture: part of the compilation config that -O and -cc set: result.
COMPILATION = frozenset({})

# vLLM's argument group `KernelConfig`.
# Kernel selection: result.
KERNEL = frozenset({})

# vLLM's argument group `VllmConfig`.
# Engine-wide configs (VllmConfig): speculative decoding, compilation (-O, -cc), kernels, KV
# transfer (the hidden-state extraction's connector): result; event publishing and profiling run-only.
ENGINE = frozenset(
    {
        "--kv-events-config",  # publishes KV cache events
        "--profiler-config",  # profiling
    }
)

RUN_ONLY_OPTIONS: frozenset[str] = frozenset().union(
    SERVER,
    FRONTEND,
    MODEL,
    LOAD,
    ATTENTION,
    MAMBA,
    STRUCTURED_OUTPUTS,
    PARALLEL,
    CACHE,
    OFFLOAD,
    MULTIMODAL,
    LORA,
    LOGGING,
    OBSERVABILITY,
    SCHEDULER,
    COMPILATION,
    KERNEL,
    ENGINE,
)
