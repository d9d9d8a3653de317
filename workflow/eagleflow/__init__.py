"""eagleflow: a Snakemake DAG that trains speculative-decoding drafts (EAGLE-3 and the other
methods of train.methods) for a verifier served by vLLM."""
