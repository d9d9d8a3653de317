rule dataset:
    input:
        responses=results("synth/responses.parquet"),
        quality=results("synth/quality.json"),
    output:
        train=results("dataset/train.parquet"),
        eval=results("dataset/eval.parquet"),
    log:
        logs("dataset"),
    benchmark:
        benchmarks("dataset")
    conda:
        "../envs/data.yaml"
    params:
        dataset=rule_params.section_param(config, "dataset"),
        code=code("dataset"),
    script:
        "../eagleflow/entry/dataset.py"
