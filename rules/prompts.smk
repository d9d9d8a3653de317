rule prompts:
    input:
        source=config["prompts"]["source"],
    output:
        train=results("prompts/train.jsonl"),
        eval=results("prompts/eval.jsonl"),
    log:
        logs("prompts"),
    conda:
        "../envs/data.yaml"
    params:
        prompts=section("prompts"),
        code=code("prompts"),
    script:
        "../workflow_scripts/entry/prompts.py"
