from eagleflow.report.best import main

main(snakemake)
