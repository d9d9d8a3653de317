rule benchmark:
    input:
        verifier=VERIFIER_DIR,
        draft=results("draft"),
        prompts=results("prompts/eval.jsonl"),
    output:
        report=results("benchmark/report.json"),
    params:
        server=section("server"),
        benchmark=section("benchmark"),
        code=code("benchmark.run"),
    log:
        logs("benchmark"),
    benchmark:
        benchmarks("benchmark")
    threads: workflow.cores
    script:
        "../workflow_scripts/entry/benchmark.py"
