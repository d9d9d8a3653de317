from workflow_scripts.common.smk import stage
from workflow_scripts.report import run_report

with stage(snakemake):  # noqa: F821 (injected by Snakemake)
    smk = snakemake  # noqa: F821
    run_report(
        smk.input.report, smk.input.metrics, smk.input.quality, smk.input.vocab_stats,
        smk.output.md, smk.output.acceptance_png, smk.output.training_png,
    )  # fmt: skip
