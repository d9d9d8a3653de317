from workflow_scripts.common.smk import stage
from workflow_scripts.vocab import run_vocab

with stage(snakemake):  # noqa: F821 (injected by Snakemake)
    smk = snakemake  # noqa: F821
    run_vocab(
        smk.input.train,
        smk.input.eval,
        smk.input.verifier,
        smk.params.draft_vocab_size,
        smk.output.vocab_map,
        smk.output.stats,
    )
