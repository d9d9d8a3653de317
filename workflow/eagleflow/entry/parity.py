from eagleflow.benchmark.parity import main

main(snakemake)
