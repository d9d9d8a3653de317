from workflow_scripts.common.smk import stage
from workflow_scripts.dataset import run_dataset

with stage(snakemake):  # noqa: F821 (injected by Snakemake)
    smk = snakemake  # noqa: F821
    d = smk.params.dataset
    run_dataset(
        smk.input.responses,
        smk.input.quality,
        smk.output.train,
        smk.output.eval,
        max_seq_len=d["max_seq_len"],
        eval_fraction=d["eval_fraction"],
        seed=d.get("seed", 0),
        max_defect_fraction=d["max_defect_fraction"],
        exclude_defects=d.get("exclude_defects", []),
    )
