from workflow_scripts.common.smk import stage
from workflow_scripts.train.launch import run_stage

with stage(snakemake):  # noqa: F821 (injected by Snakemake)
    smk = snakemake  # noqa: F821
    nproc = smk.params.train.get("nproc_per_node", 1)
    run_stage(
        {
            "shards": list(smk.input.shards),
            "vocab_map": smk.input.vocab_map,
            "index": smk.input.index,
            "verifier_dir": smk.input.verifier,
            "draft_out": smk.output.draft,
            "metrics_out": smk.output.metrics,
            "checkpoint_dir": smk.params.checkpoint_dir,
            "serve_verifier_path": smk.params.serve_verifier_path,
            "cfg": smk.params.train,
            "threads": smk.threads,
        },
        nproc,
    )
