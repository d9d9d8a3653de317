from pathlib import Path

from workflow_scripts.benchmark.run import run_benchmark
from workflow_scripts.common.server import ServerSpec
from workflow_scripts.common.smk import stage

with stage(snakemake):  # noqa: F821 (injected by Snakemake)
    smk = snakemake  # noqa: F821
    run_benchmark(
        smk.input.prompts,
        smk.input.verifier,
        smk.input.draft,
        smk.output.report,
        str(Path(smk.log[0]).parent),
        server=ServerSpec.from_config(smk.params.server, smk.input.verifier),
        cfg=smk.params.benchmark,
    )
