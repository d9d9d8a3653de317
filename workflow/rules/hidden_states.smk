# One extraction server (vLLM, or transformers for the hf backend) serves every shard job:
# the first job launches it, the others attach, and hidden_states_index stops it
# (workflow/eagleflow/hidden_states/backend.py: sharing). The SLURM profile puts the shard
# jobs in one group, so that they run in one submission on the node holding the server.
rule hidden_states:
    input:
        verifier=VERIFIER_DIR,
        train=results("dataset/train.parquet"),
        eval=results("dataset/eval.parquet"),
    output:
        results("hidden_states/shard-{shard}.safetensors"),
    log:
        logs("hidden_states.shard-{shard}"),
    benchmark:
        benchmarks("hidden_states.shard-{shard}")
    # Before other GPU jobs that are ready at the same time: between two shard jobs the
    # server would otherwise hold the GPUs another job was given.
    priority: 10
    conda:
        EXTRACTION_ENVS[config["hidden_states"]["backend"]]
    threads: all_cores()
    resources:
        gpu=gpus("hidden_states"),
    params:
        hidden_states=section("hidden_states"),
        server=hidden_states_server(),
        trust_remote_code=config["verifier"]["trust_remote_code"],
        code=code("hidden_states"),
    script:
        "../eagleflow/entry/hidden_states.py"


rule hidden_states_index:
    input:
        verifier=VERIFIER_DIR,
        shards=shard_paths(),
    output:
        results("hidden_states/index.json"),
    log:
        logs("hidden_states_index"),
    conda:
        "../envs/train.yaml"
    params:
        code=code("hidden_states_index"),
    script:
        "../eagleflow/entry/hidden_states_index.py"
