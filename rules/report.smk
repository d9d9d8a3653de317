rule report:
    input:
        report=results("benchmark/report.json"),
        metrics=results("train/metrics.jsonl"),
        quality=results("synth/quality.json"),
        vocab_stats=results("vocab/stats.json"),
    output:
        md=results("benchmark/report.md"),
        acceptance_png=results("benchmark/acceptance_per_position.png"),
        training_png=results("benchmark/training_curves.png"),
    log:
        logs("report"),
    conda:
        "../envs/data.yaml"
    params:
        code=code("report"),
    script:
        "../workflow_scripts/entry/report.py"
