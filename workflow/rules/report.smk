rule report:
    input:
        report=variant_results("benchmark/report.json"),
        metrics=variant_draft("train/metrics.jsonl"),
        quality=results("synth/quality.json"),
        vocab_stats=variant_vocab("stats.json"),
        generate=results("generate/stats.json"),
        parity=parity_report,
        prompts=results("prompts/stats.json"),
    output:
        md=variant_results("report/report.md"),
        html=report(
            variant_results("report/summary.html"),
            caption="../report/summary.rst",
            category="1. Benchmark",
            subcategory="{variant}",
            labels={"variant": "{variant}", "figure": "summary"},
        ),
        acceptance_png=report(
            variant_results("report/acceptance_per_position.png"),
            caption="../report/acceptance.rst",
            category="1. Benchmark",
            subcategory="{variant}",
            labels={"variant": "{variant}", "figure": "acceptance per position"},
        ),
        context_png=report(
            variant_results("report/acceptance_by_context.png"),
            caption="../report/context.rst",
            category="1. Benchmark",
            subcategory="{variant}",
            labels={"variant": "{variant}", "figure": "acceptance by context length"},
        ),
        training_png=report(
            variant_results("report/training_curves.png"),
            caption="../report/training.rst",
            category="2. Training",
            subcategory="{variant}",
            labels={"variant": "{variant}", "figure": "training curves"},
        ),
        quality_png=report(
            variant_results("report/data_quality.png"),
            caption="../report/quality.rst",
            category="3. Data",
            subcategory="{variant}",
            labels={"variant": "{variant}", "figure": "data quality"},
        ),
        vocab_png=report(
            variant_results("report/vocab_coverage.png"),
            caption="../report/vocab.rst",
            category="3. Data",
            subcategory="{variant}",
            labels={"variant": "{variant}", "figure": "vocabulary coverage"},
        ),
        prompts_png=report(
            variant_results("report/training_prompts.png"),
            caption="../report/prompts.rst",
            category="3. Data",
            subcategory="{variant}",
            labels={"variant": "{variant}", "figure": "training prompts"},
        ),
    log:
        logs("report.{variant}"),
    conda:
        "../envs/data.yaml"
    params:
        estimate=per_variant(rule_params.acceptance_estimate),
        code=code("report"),
    script:
        "../eagleflow/entry/report.py"


rule compare:
    input:
        reports=every_variant("benchmark/report.json"),
        metrics=every_draft("train/metrics.jsonl"),
        drafts=every_draft("draft"),
        variant_reports=every_variant("report/report.md"),
        train_benchmarks=every_train_benchmark(),
        generate=results("generate/stats.json"),
    output:
        md=results("report.md"),
        html=report(
            results("report/comparison.html"),
            caption="../report/comparison.rst",
            category="0. Comparison",
            labels={"figure": "table"},
        ),
        acceptance_png=report(
            results("report/acceptance_by_variant.png"),
            caption="../report/acceptance_by_variant.rst",
            category="0. Comparison",
            labels={"figure": "acceptance per position, per variant"},
        ),
        learning_curve_png=report(
            results("report/learning_curve.png"),
            caption="../report/learning_curve.rst",
            category="0. Comparison",
            labels={"figure": "learning curve"},
        ),
        k_png=report(
            results("report/speculative_tokens.png"),
            caption="../report/speculative_tokens.rst",
            category="0. Comparison",
            labels={"figure": "number of speculative tokens"},
        ),
        concurrency_png=report(
            results("report/generate_concurrency.png"),
            caption="../report/generate_concurrency.rst",
            category="0. Comparison",
            labels={"figure": "generate concurrency"},
        ),
    log:
        logs("compare"),
    conda:
        "../envs/data.yaml"
    params:
        variants=VARIANTS,
        learning_curve=rule_params.learning_curve_variants(config),
        k_variants=rule_params.k_variants(config),
        code=code("compare"),
    script:
        "../eagleflow/entry/compare.py"


rule best_draft:
    input:
        reports=every_variant("benchmark/report.json"),
        drafts=every_draft("draft"),
    output:
        draft=directory(results("best/draft")),
        choice=results("best/choice.json"),
    log:
        logs("best_draft"),
    conda:
        "../envs/data.yaml"
    params:
        variants=VARIANTS,
        best=config["best"],
        code=code("best_draft"),
    script:
        "../eagleflow/entry/best_draft.py"
