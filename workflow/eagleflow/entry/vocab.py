from eagleflow.vocab import main

main(snakemake)
