from workflow_scripts.common.smk import stage
from workflow_scripts.hidden_states.run import run_shard

with stage(snakemake):  # noqa: F821 (injected by Snakemake)
    smk = snakemake  # noqa: F821
    run_shard(
        smk.input.train,
        smk.input.eval,
        smk.input.verifier,
        int(smk.wildcards.shard),
        smk.params.hidden_states["num_shards"],
        smk.output[0],
        settings=smk.params.hidden_states,
        server=smk.params.server,
        threads=smk.threads,
        trust_remote_code=smk.params.trust_remote_code,
        log_path=smk.log[0],
    )
