from workflow_scripts.compare import main

main(snakemake)
