"""Mechanisms every stage shares: atomic writes, config access, the vLLM launcher, the chat client."""
