rule write_prompts:
    input:
        verifier=VERIFIER_DIR,
    output:
        written=results("prompts/written.jsonl"),
        stats=results("prompts/written_stats.json"),
    log:
        main=logs("write_prompts"),
        vllm=logs("write_prompts.vllm"),
    benchmark:
        benchmarks("write_prompts")
    conda:
        "../envs/serve.yaml"
    threads: all_cores()
    resources:
        gpu=rule_params.gpus(config, "generate"),
    params:
        written=rule_params.written_section(config),
        model=config["server"]["served_model_name"],
        # generate's requests, for the replies between written turns (none for one turn)
        replies=rule_params.written_replies(config),
        chat_template_kwargs=rule_params.chat_template_kwargs(config),
        trust_remote_code=config["verifier"]["trust_remote_code"],
        server=server_result_args(),
        # Not an output: the store outlives every job, and a rerun sends only what it lacks.
        store=response_store(),
        code=code("write_prompts"),
    script:
        "../eagleflow/entry/write_prompts.py"


rule prompts:
    input:
        unpack(prompt_sources),
    output:
        train=results("prompts/train.jsonl"),
        eval=results("prompts/eval.jsonl"),
        stats=results("prompts/stats.json"),
    log:
        logs("prompts"),
    conda:
        "../envs/data.yaml"
    params:
        prompts=rule_params.section_param(config, "prompts"),
        benchmark_sets=rule_params.overlap_sets(config),
        code=code("prompts"),
    script:
        "../eagleflow/entry/prompts.py"
