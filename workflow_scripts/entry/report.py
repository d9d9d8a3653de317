from workflow_scripts.common.smk import stage
from workflow_scripts.report import run_report

with stage(snakemake):  # noqa: F821 (injected by Snakemake)
    smk = snakemake  # noqa: F821
    outputs = {
        name: smk.output[name] for name in ("md", "html", "acceptance_png", "training_png", "quality_png", "vocab_png")
    }
    run_report(
        smk.input.report, smk.input.metrics, smk.input.quality, smk.input.vocab_stats, smk.input.generate, outputs
    )
