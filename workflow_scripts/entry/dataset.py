from workflow_scripts.dataset import main

main(snakemake)
