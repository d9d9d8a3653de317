from workflow_scripts.common.smk import stage
from workflow_scripts.generate.run import Client, Requests, run_generate

with stage(snakemake):  # noqa: F821 (injected by Snakemake)
    smk = snakemake  # noqa: F821
    server, synth = smk.config["server"], smk.config["synth"]
    # Operational settings come from the config, not params: changing them must not rerun the rule.
    client = Client(synth["concurrency"], synth["request_timeout_s"], synth["max_attempts"], server.get("api_key_env"))
    run_generate(
        smk.input.prompts,
        smk.input.verifier,
        smk.params.store,
        smk.output.replies,
        smk.output.stats,
        requests=Requests(**smk.params.requests),
        client=client,
        server=server,
        server_log=smk.log.vllm,
        endpoint=server.get("endpoint"),
    )
