rule generate:
    input:
        verifier=VERIFIER_DIR,
        prompts=results("prompts/train.jsonl"),
    output:
        replies=results("generate/shards/{part}/replies.parquet"),
        stats=results("generate/shards/{part}/stats.json"),
    log:
        main=logs("generate.{part}"),
        vllm=logs("generate.{part}.vllm"),
    benchmark:
        benchmarks("generate.{part}")
    conda:
        "../envs/serve.yaml"
    threads: all_cores()
    resources:
        gpu=rule_params.gpus(config, "generate"),
    params:
        requests=rule_params.generate_requests(config),
        server=server_result_args(),
        # Not an output: the store outlives every job, and a rerun sends only what it lacks.
        # Each shard writes its own file beside it (runtime/response_store.py).
        store=response_store(),
        code=code("generate"),
    script:
        "../eagleflow/entry/generate.py"


rule generate_join:
    input:
        prompts=results("prompts/train.jsonl"),
        replies=expand(
            results("generate/shards/{part}/replies.parquet"),
            part=rule_params.generate_shards(config),
        ),
        stats=expand(
            results("generate/shards/{part}/stats.json"),
            part=rule_params.generate_shards(config),
        ),
    output:
        replies=results("generate/replies.parquet"),
        stats=results("generate/stats.json"),
    log:
        main=logs("generate_join"),
    conda:
        "../envs/data.yaml"
    params:
        code=code("generate_join"),
    script:
        "../eagleflow/entry/generate_join.py"
