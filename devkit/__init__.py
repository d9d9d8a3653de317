"""Builders that the tests and the benchmarks share: the config sections as a run has them
(configs), tiny verifiers built from a config with nothing downloaded (verifiers), a local
OpenAI-compatible server for what vLLM cannot be made to do (fake_openai), and synthetic
inputs of the training stage (train_inputs). Not part of the eagleflow package: nothing in
the workflow imports it."""
