"""eagleflow: a Snakemake DAG that trains EAGLE-3 drafts for a verifier served by vLLM."""
