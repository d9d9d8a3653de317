from eagleflow.generate.join import main

main(snakemake)
