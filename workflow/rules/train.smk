rule train:
    input:
        unpack(train_states),
        verifier=VERIFIER_DIR,
        vocab_map=draft_vocab("vocab_map.safetensors"),
    output:
        draft=directory(draft_results("draft")),
        metrics=draft_results("train/metrics.jsonl"),
    log:
        logs("train.{draft}"),
    benchmark:
        benchmarks("train.{draft}")
    # Every draft trained before any parity job, as every benchmark is (rules/benchmark.smk):
    # the parity jobs then run back to back on one extraction server.
    priority: 1
    conda:
        "../envs/train.yaml"
    threads: all_cores()
    resources:
        gpu=rule_params.gpus(config, "train"),
        # Served mode with placement: nodes: one node more per extraction server (SLURM --nodes),
        # a task on each (SLURM fits --ntasks=1 on one node, whatever --nodes says).
        nodes=rule_params.train_nodes(config),
        tasks=rule_params.train_nodes(config),
    params:
        train=draft_section("train"),
        serve_verifier_path=serve_verifier_path,
        checkpoint_dir=checkpoint_dir,
        online=rule_params.online_states(config),
        served=rule_params.served_states(config, VERIFIER_ARGV),
        code=code("train"),
    script:
        "../eagleflow/entry/train.py"
