from eagleflow.benchmark.set_job import main

main(snakemake)
