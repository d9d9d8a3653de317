from workflow_scripts.benchmark.run import main_baseline

main_baseline(snakemake)
