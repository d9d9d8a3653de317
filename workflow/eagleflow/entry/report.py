from eagleflow.report.variant import main

main(snakemake)
