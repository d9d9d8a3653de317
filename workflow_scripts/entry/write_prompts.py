from workflow_scripts.prompts.written import main

main(snakemake)
