rule baseline:
    input:
        verifier=VERIFIER_DIR,
        prompts=results("prompts/eval.jsonl"),
    output:
        report=results("baseline/report.json"),
    log:
        logs("baseline"),
    benchmark:
        benchmarks("baseline")
    conda:
        "../envs/serve.yaml"
    threads: all_cores()
    resources:
        gpu=gpus("benchmark"),
    params:
        server=section("server"),
        workload=baseline_workload(),
        code=code("baseline"),
    script:
        "../workflow_scripts/entry/baseline.py"


rule benchmark:
    input:
        verifier=VERIFIER_DIR,
        draft=variant_draft("draft"),
        prompts=results("prompts/eval.jsonl"),
        baseline=baseline_report,
    output:
        report=variant_results("benchmark/report.json"),
    log:
        logs("benchmark.{variant}"),
    benchmark:
        benchmarks("benchmark.{variant}")
    conda:
        "../envs/serve.yaml"
    threads: all_cores()
    resources:
        gpu=gpus("benchmark"),
    params:
        server=section("server"),
        benchmark=variant_section("benchmark"),
        code=code("benchmark"),
    script:
        "../workflow_scripts/entry/benchmark.py"
