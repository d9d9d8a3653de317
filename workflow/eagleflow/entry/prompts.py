from eagleflow.prompts.run import main

main(snakemake)
