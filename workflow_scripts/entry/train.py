from workflow_scripts.train.launch import main

main(snakemake)
