from eagleflow.prepare_verifier import main

main(snakemake)
