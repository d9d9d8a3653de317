rule train:
    input:
        verifier=VERIFIER_DIR,
        index=results("hidden_states/index.json"),
        shards=shard_paths(),
        vocab_map=results("vocab/vocab_map.safetensors"),
    output:
        draft=directory(results("draft")),
        metrics=results("train/metrics.jsonl"),
    log:
        logs("train"),
    benchmark:
        benchmarks("train")
    conda:
        "../envs/train.yaml"
    threads: all_cores()
    resources:
        gpu=gpus("train"),
    params:
        train=section("train"),
        serve_verifier_path=serve_verifier_path(),
        # Not an output: a failed or killed job's checkpoints must survive for the rerun to resume.
        checkpoint_dir=results("train/checkpoints"),
        code=code("train"),
    script:
        "../workflow_scripts/entry/train.py"
