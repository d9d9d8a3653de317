from eagleflow.hidden_states.index import main

main(snakemake)
