from workflow_scripts.prompts.run import main

main(snakemake)
