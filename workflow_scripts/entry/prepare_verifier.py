from workflow_scripts.prepare_verifier import main

main(snakemake)
