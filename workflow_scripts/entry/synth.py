from workflow_scripts.common.server import serve
from workflow_scripts.common.smk import server_spec, stage
from workflow_scripts.synth.generate import run_synth

with stage(snakemake):  # noqa: F821 (injected by Snakemake)
    smk = snakemake  # noqa: F821
    server, synth = smk.params.server, smk.params.synth
    sampling = {k: synth[k] for k in ("max_tokens", "temperature", "top_p", "seed") if synth.get(k) is not None}
    sampling |= synth.get("extra_body") or {}
    cfg = {
        **{k: synth[k] for k in ("concurrency", "request_timeout_s", "max_attempts", "expect_reasoning")},
        "think_markers": synth.get("think_markers"),
        "chat_template_kwargs": synth.get("chat_template_kwargs") or {},
        "verify_token_ids": synth.get("verify_token_ids", False),
        "trust_remote_code": smk.params.trust_remote_code,
        "sampling": sampling,
        "served_model_name": server.get("served_model_name", "verifier"),
        "api_key_env": server.get("api_key_env"),
        "verifier": smk.params.verifier_identity,
    }
    with serve(server_spec(server, smk.input.verifier), smk.log.vllm, server.get("endpoint")) as base_url:
        run_synth(
            smk.input.prompts, base_url, smk.params.cache_dir, smk.output.responses, smk.output.errors, smk.output.quality,
            cfg, verifier_dir=smk.input.verifier,
        )  # fmt: skip
