from eagleflow.benchmark.run import main_baseline

main_baseline(snakemake)
