from pathlib import Path

from workflow_scripts.benchmark.run import run_benchmark
from workflow_scripts.common.smk import server_spec, stage

with stage(snakemake):  # noqa: F821 (injected by Snakemake)
    smk = snakemake  # noqa: F821
    run_benchmark(
        smk.input.prompts, smk.input.verifier, smk.input.draft, smk.output.report, str(Path(smk.log[0]).parent),
        server=server_spec(smk.params.server, smk.input.verifier), cfg=smk.params.benchmark,
    )  # fmt: skip
