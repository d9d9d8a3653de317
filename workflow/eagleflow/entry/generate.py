from eagleflow.generate.run import main

main(snakemake)
