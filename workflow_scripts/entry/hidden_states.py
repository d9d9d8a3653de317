from workflow_scripts.hidden_states.run import main

main(snakemake)
