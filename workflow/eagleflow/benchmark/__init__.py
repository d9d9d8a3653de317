"""benchmark: the verifier served by vLLM with and without the draft, measured side by side."""
