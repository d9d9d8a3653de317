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
        verifier=section("verifier"),
        code=code("prepare_verifier"),
    script:
        "../workflow_scripts/entry/prepare_verifier.py"
