from eagleflow.synth.run import main

main(snakemake)
