from eagleflow.benchmark.baseline import main_baseline

main_baseline(snakemake)
