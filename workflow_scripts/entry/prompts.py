from workflow_scripts.common.smk import stage
from workflow_scripts.prompts import run_prompts

with stage(snakemake):  # noqa: F821 (injected by Snakemake)
    smk = snakemake  # noqa: F821
    p = smk.params.prompts
    run_prompts(
        smk.input.source,
        smk.output.train,
        smk.output.eval,
        eval_fraction=p["eval_fraction"],
        seed=p.get("seed", 0),
        max_train=p.get("max_train"),
        max_eval=p.get("max_eval"),
    )
