from workflow_scripts.prompts import main

main(snakemake)
