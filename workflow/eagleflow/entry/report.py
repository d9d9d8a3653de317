from eagleflow.report import main

main(snakemake)
