from eagleflow.train.launch import main

main(snakemake)
