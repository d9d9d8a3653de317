from eagleflow.prompts.written import main

main(snakemake)
