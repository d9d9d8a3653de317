rule synth:
    input:
        verifier=VERIFIER_DIR,
        prompts=results("prompts/train.jsonl"),
    output:
        responses=results("synth/responses.parquet"),
        errors=results("synth/errors.jsonl"),
        quality=results("synth/quality.json"),
    log:
        main=logs("synth"),
        vllm=logs("synth.vllm"),
    benchmark:
        benchmarks("synth")
    conda:
        "../envs/serve.yaml"
    threads: all_cores()
    resources:
        gpu=gpus("synth"),
    params:
        server=section("server"),
        synth=section("synth"),
        verifier_identity=verifier_identity(),
        trust_remote_code=config["verifier"].get("trust_remote_code", False),
        cache_dir=results("synth/cache"),
        code=code("synth.generate"),
    script:
        "../workflow_scripts/entry/synth.py"
