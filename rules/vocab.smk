rule vocab:
    input:
        verifier=VERIFIER_DIR,
        train=results("dataset/train.parquet"),
        eval=results("dataset/eval.parquet"),
    output:
        vocab_map=results("vocab/vocab_map.safetensors"),
        stats=results("vocab/stats.json"),
    log:
        logs("vocab"),
    benchmark:
        benchmarks("vocab")
    params:
        draft_vocab_size=config["vocab"]["draft_vocab_size"],
        code=code("vocab"),
    script:
        "../workflow_scripts/entry/vocab.py"
