from workflow_scripts.report import main

main(snakemake)
