"""synth: parse the verifier's raw replies (from generate) into samples with exact token
streams, and account for their defects."""
