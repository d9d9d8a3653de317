"""synth: generate the verifier's own responses to the train prompts through its OpenAI-compatible server."""
