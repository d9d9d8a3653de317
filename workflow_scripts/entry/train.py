from workflow_scripts.common.smk import stage
from workflow_scripts.train.loop import run_train

with stage(snakemake):  # noqa: F821 (injected by Snakemake)
    smk = snakemake  # noqa: F821
    run_train(
        list(smk.input.shards), smk.input.vocab_map, smk.input.verifier, smk.output.draft, smk.output.metrics,
        serve_verifier_path=smk.params.serve_verifier_path, cfg=smk.params.train, threads=smk.threads,
    )  # fmt: skip
