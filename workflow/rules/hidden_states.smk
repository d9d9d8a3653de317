# The hidden states are kept per sample (runtime/state_store.py, keyed by
# hidden_states/sample_keys.py): each job extracts the samples of its part (a stable hash of
# their ids) that the store lacks and writes the part's manifest, so a grown or corrected
# dataset extracts only what it adds or changes. One job per node (hidden_states.num_parts),
# each with its own extraction server (vLLM, or transformers for the hf backend); a job with
# nothing to extract starts none. Under SLURM each job is a whole node's submission.
rule hidden_states:
    input:
        verifier=VERIFIER_DIR,
        train=results("dataset/train.parquet"),
        eval=results("dataset/eval.parquet"),
    output:
        results("hidden_states/part-{states_part}.json"),
    log:
        logs("hidden_states.part-{states_part}"),
    benchmark:
        benchmarks("hidden_states.part-{states_part}")
    # Before other GPU jobs that are ready at the same time: the phase's jobs take whole nodes
    # (a GPU host's every GPU), and training waits for their index anyway.
    priority: 10
    conda:
        EXTRACTION_ENVS[config["hidden_states"]["backend"]]
    threads: all_cores()
    resources:
        gpu=rule_params.gpus(config, "hidden_states"),
    params:
        hidden_states=rule_params.section_param(config, "hidden_states", ["served"]),
        server=rule_params.hidden_states_server(config, VERIFIER_ARGV),
        trust_remote_code=config["verifier"]["trust_remote_code"],
        code=code("hidden_states"),
    script:
        "../eagleflow/entry/hidden_states.py"


rule hidden_states_index:
    input:
        verifier=VERIFIER_DIR,
        parts=part_paths(),
    output:
        index=results("hidden_states/index.json"),
        stats=results("hidden_states/stats.json"),
    log:
        logs("hidden_states_index"),
    conda:
        "../envs/train.yaml"
    # The extraction's settings, as the part jobs have them: not read here, but a change reruns
    # the index, and with it a part whose manifest a killed job left missing (Snakemake does
    # not rebuild a missing input of an output it holds for current).
    params:
        hidden_states=rule_params.section_param(config, "hidden_states", ["served"]),
        server=rule_params.hidden_states_server(config, VERIFIER_ARGV),
        code=code("hidden_states_index"),
    script:
        "../eagleflow/entry/hidden_states_index.py"
