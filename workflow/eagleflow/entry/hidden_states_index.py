from eagleflow.hidden_states.shards import main

main(snakemake)
