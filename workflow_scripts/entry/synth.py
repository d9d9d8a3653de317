from workflow_scripts.synth.run import main

main(snakemake)
