"""vLLM's options of the server process, the HTTP frontend, the model, loading, attention,
Mamba and structured outputs (common.vllm_flags)."""

from __future__ import annotations

from eagleflow.common.vllm_flags.kinds import RESULT, RUN_ONLY, Flag

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
