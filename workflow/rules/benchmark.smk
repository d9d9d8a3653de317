rule benchmark_sets:
    input:
        verifier=VERIFIER_DIR,
        prompts=results("prompts/eval.jsonl"),
    output:
        sets=results("benchmark_sets.json"),
    log:
        logs("benchmark_sets"),
    conda:
        "../envs/serve.yaml"
    params:
        sets=rule_params.benchmark_sets(config),
        eval_size=config["benchmark"]["num_prompts"],
        max_tokens=config["benchmark"]["max_tokens"],
        max_model_len=config["server"]["max_model_len"],
        chat_template_kwargs=rule_params.chat_template_kwargs(config),
        code=code("benchmark_sets"),
    script:
        "../eagleflow/entry/benchmark_sets.py"


rule baseline:
    input:
        verifier=VERIFIER_DIR,
        sets=results("benchmark_sets.json"),
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
        gpu=rule_params.gpus(config, "benchmark"),
    params:
        server=rule_params.measured_server(config, VERIFIER_ARGV),
        workload=rule_params.baseline_workload(config),
        code=code("baseline"),
    script:
        "../eagleflow/entry/baseline.py"


rule benchmark:
    input:
        verifier=VERIFIER_DIR,
        draft=variant_draft("draft"),
        sets=results("benchmark_sets.json"),
        baseline=baseline_report,
    output:
        report=variant_results("benchmark/report.json"),
        streams=variant_results("benchmark/streams.jsonl"),
    log:
        logs("benchmark.{variant}"),
    benchmark:
        benchmarks("benchmark.{variant}")
    # Every variant's benchmark before any parity job: the parity jobs then run back to back
    # and share one extraction server (workflow/eagleflow/benchmark/parity.py).
    priority: 1
    conda:
        "../envs/serve.yaml"
    threads: all_cores()
    resources:
        gpu=rule_params.gpus(config, "benchmark"),
    params:
        server=rule_params.measured_server(config, VERIFIER_ARGV),
        benchmark=variant_section("benchmark"),
        serving=per_variant(rule_params.draft_serving),
        chat_template_kwargs=rule_params.chat_template_kwargs(config),
        code=code("benchmark"),
    script:
        "../eagleflow/entry/benchmark.py"


rule parity:
    input:
        verifier=VERIFIER_DIR,
        draft=variant_draft("draft"),
        vocab_map=variant_vocab("vocab_map.safetensors"),
        streams=variant_results("benchmark/streams.jsonl"),
        report=variant_results("benchmark/report.json"),
        metrics=variant_draft("train/metrics.jsonl"),
        prompts=results("prompts/eval.jsonl"),
        train=results("dataset/train.parquet"),
    output:
        report=variant_results("parity/report.json"),
    log:
        logs("parity.{variant}"),
    conda:
        EXTRACTION_ENVS[config["hidden_states"]["backend"]]
    threads: all_cores()
    resources:
        gpu=rule_params.gpus(config, "hidden_states"),
    params:
        # The verifier's states as the hidden_states stage computes them, with its backend.
        hidden_states=rule_params.section_param(config, "hidden_states", ["served"]),
        server=rule_params.hidden_states_server(config, VERIFIER_ARGV),
        trust_remote_code=config["verifier"]["trust_remote_code"],
        chat_template_kwargs=rule_params.chat_template_kwargs(config),
        synth_temperature=config["generate"]["temperature"],
        parity=rule_params.section_param(config, "parity"),
        max_model_len=config["server"]["max_model_len"],
        max_seq_len=config["dataset"]["max_seq_len"],
        code=code("parity"),
    script:
        "../eagleflow/entry/parity.py"
