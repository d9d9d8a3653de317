rule benchmark:
    input:
        verifier=VERIFIER_DIR,
        draft=results("draft"),
        prompts=results("prompts/eval.jsonl"),
    output:
        report=results("benchmark/report.json"),
    log:
        logs("benchmark"),
    benchmark:
        benchmarks("benchmark")
    conda:
        "../envs/serve.yaml"
    threads: all_cores()
    resources:
        gpu=gpus("benchmark"),
    params:
        server=section("server"),
        benchmark=section("benchmark"),
        code=code("benchmark"),
    script:
        "../workflow_scripts/entry/benchmark.py"
