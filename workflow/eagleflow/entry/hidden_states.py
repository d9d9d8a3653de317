from eagleflow.hidden_states.run import main

main(snakemake)
