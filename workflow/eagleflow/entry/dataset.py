from eagleflow.dataset import main

main(snakemake)
