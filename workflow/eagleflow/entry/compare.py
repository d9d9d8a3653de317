from eagleflow.compare import main

main(snakemake)
