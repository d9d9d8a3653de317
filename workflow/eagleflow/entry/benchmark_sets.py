from eagleflow.benchmark.sized_sets import main

main(snakemake)
