from workflow_scripts.common.smk import stage
from workflow_scripts.hidden_states import run_shard

with stage(snakemake):  # noqa: F821 (injected by Snakemake)
    smk = snakemake  # noqa: F821
    h = smk.params.hidden_states
    run_shard(
        smk.input.train, smk.input.eval, smk.input.verifier, int(smk.wildcards.shard), h["num_shards"], smk.output[0],
        aux_layer_ids=h.get("aux_layer_ids"), batch_tokens=h["batch_tokens"], dtype=h["dtype"], device=h["device"],
        threads=smk.threads, trust_remote_code=smk.params.trust_remote_code,
    )  # fmt: skip
