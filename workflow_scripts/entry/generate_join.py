from workflow_scripts.generate.join import main

main(snakemake)
