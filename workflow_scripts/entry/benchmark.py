from workflow_scripts.benchmark.run import main

main(snakemake)
