from workflow_scripts.hidden_states.shards import main

main(snakemake)
