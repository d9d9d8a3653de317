from workflow_scripts.vocab import main

main(snakemake)
