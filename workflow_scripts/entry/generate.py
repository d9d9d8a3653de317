from workflow_scripts.generate.run import main

main(snakemake)
