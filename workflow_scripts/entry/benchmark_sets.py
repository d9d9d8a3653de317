from workflow_scripts.benchmark.set_job import main

main(snakemake)
