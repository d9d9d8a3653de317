rule prepare_verifier:
    output:
        directory(VERIFIER_DIR),
    log:
        logs("prepare_verifier"),
    benchmark:
        benchmarks("prepare_verifier")
    conda:
        "../envs/train.yaml"
    params:
        # Only where the weights come from: serve_path and trust_remote_code do not change them.
        verifier_source=rule_params.verifier_source(config),
        code=code("prepare_verifier"),
    script:
        "../eagleflow/entry/prepare_verifier.py"
