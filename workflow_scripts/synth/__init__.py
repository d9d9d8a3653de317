"""synth: generate the verifier's own responses to the train prompts through its OpenAI-compatible server."""

from workflow_scripts.synth.generate import run_synth

__all__ = ["run_synth"]
