"""vLLM's options of parallelism, the KV cache, offloading, multimodal inputs, LoRA, logging,
observability, the scheduler, compilation, kernels and the engine (common.vllm_flags)."""

from __future__ import annotations

from eagleflow.common.vllm_flags.kinds import RESULT, RUN_ONLY, Flag

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
