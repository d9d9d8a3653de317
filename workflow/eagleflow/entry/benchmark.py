from eagleflow.benchmark.run import main

main(snakemake)
