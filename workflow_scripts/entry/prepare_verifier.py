from workflow_scripts.common.smk import stage
from workflow_scripts.prepare_verifier import prepare_verifier

with stage(snakemake):  # noqa: F821 (injected by Snakemake)
    v = snakemake.params.verifier  # noqa: F821
    prepare_verifier(v["source"], snakemake.output[0], v.get("path"))  # noqa: F821
