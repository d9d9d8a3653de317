rule report:
    input:
        report=results("benchmark/report.json"),
        metrics=results("train/metrics.jsonl"),
        quality=results("synth/quality.json"),
        vocab_stats=results("vocab/stats.json"),
        generate=results("generate/stats.json"),
    output:
        md=results("benchmark/report.md"),
        html=report(
            results("benchmark/summary.html"),
            caption="report/summary.rst",
            category="1. Benchmark",
            labels={"figure": "summary"},
        ),
        acceptance_png=report(
            results("benchmark/acceptance_per_position.png"),
            caption="report/acceptance.rst",
            category="1. Benchmark",
            labels={"figure": "acceptance per position"},
        ),
        training_png=report(
            results("benchmark/training_curves.png"),
            caption="report/training.rst",
            category="2. Training",
            labels={"figure": "training curves"},
        ),
        quality_png=report(
            results("benchmark/data_quality.png"),
            caption="report/quality.rst",
            category="3. Data",
            labels={"figure": "data quality"},
        ),
        vocab_png=report(
            results("benchmark/vocab_coverage.png"),
            caption="report/vocab.rst",
            category="3. Data",
            labels={"figure": "vocabulary coverage"},
        ),
    log:
        logs("report"),
    conda:
        "../envs/data.yaml"
    params:
        code=code("report"),
    script:
        "../workflow_scripts/entry/report.py"
