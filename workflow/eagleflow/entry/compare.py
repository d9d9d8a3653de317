from eagleflow.report.compare import main

main(snakemake)
