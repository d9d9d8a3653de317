# eagleflow: verifier -> synthetic data -> draft vocab -> hidden states -> EAGLE-3 draft -> vLLM benchmark.
# Table of contents only; each stage lives in rules/<stage>.smk and workflow_scripts/<stage>.


configfile: "config/config.yaml"


report: "rules/report/workflow.rst"


include: "rules/common.smk"
include: "rules/prepare_verifier.smk"
include: "rules/prompts.smk"
include: "rules/generate.smk"
include: "rules/synth.smk"
include: "rules/dataset.smk"
include: "rules/vocab.smk"
include: "rules/hidden_states.smk"
include: "rules/train.smk"
include: "rules/benchmark.smk"
include: "rules/report.smk"


rule all:
    default_target: True
    input:
        results("report.md"),
