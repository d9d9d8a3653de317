rule prompts:
    input:
        source=config["prompts"]["source"],
    output:
        train=results("prompts/train.jsonl"),
        eval=results("prompts/eval.jsonl"),
    params:
        prompts=section("prompts"),
        code=code("prompts"),
    log:
        logs("prompts"),
    script:
        "../workflow_scripts/entry/prompts.py"
