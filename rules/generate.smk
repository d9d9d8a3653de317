rule generate:
    input:
        verifier=VERIFIER_DIR,
        prompts=results("prompts/train.jsonl"),
    output:
        replies=results("generate/replies.parquet"),
        stats=results("generate/stats.json"),
    log:
        main=logs("generate"),
        vllm=logs("generate.vllm"),
    benchmark:
        benchmarks("generate")
    conda:
        "../envs/serve.yaml"
    threads: all_cores()
    resources:
        gpu=gpus("generate"),
    params:
        requests=generate_requests(),
        server=server_result_args(),
        # Not an output: the store outlives every job, and a rerun sends only what it lacks.
        store=response_store(),
        code=code("generate"),
    script:
        "../workflow_scripts/entry/generate.py"
