from workflow_scripts.benchmark.parity import main

main(snakemake)
