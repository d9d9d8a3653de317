from workflow_scripts.common.smk import stage
from workflow_scripts.hidden_states.shards import write_index

with stage(snakemake):  # noqa: F821 (injected by Snakemake)
    smk = snakemake  # noqa: F821
    write_index(list(smk.input.shards), smk.input.verifier, smk.output[0])
