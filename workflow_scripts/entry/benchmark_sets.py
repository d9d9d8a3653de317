from workflow_scripts.benchmark.sets import main

main(snakemake)
