from workflow_scripts.common.smk import stage
from workflow_scripts.synth.run import Parsing, run_synth

with stage(snakemake):  # noqa: F821 (injected by Snakemake)
    smk = snakemake  # noqa: F821
    run_synth(
        smk.input.replies,
        smk.output.responses,
        smk.output.errors,
        smk.output.quality,
        Parsing(**smk.params.parsing),
        verifier_dir=smk.input.verifier,
    )
