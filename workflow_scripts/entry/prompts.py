from workflow_scripts.common.smk import stage
from workflow_scripts.prompts import run_prompts

with stage(snakemake):  # noqa: F821 (injected by Snakemake)
    p = snakemake.params.prompts  # noqa: F821
    run_prompts(
        snakemake.input.source, snakemake.output.train, snakemake.output.eval,  # noqa: F821
        eval_fraction=p["eval_fraction"], seed=p.get("seed", 0), max_train=p.get("max_train"), max_eval=p.get("max_eval"),
    )
