"""The names of the sample defect classes: what synth finds, the dataset gate limits and the
report plots. Only names live here (the rules that detect them are in `synth.assemble` and
`synth.quality`), so a change to a defect rule restales synth and downstream, nothing else."""

DEFECTS = (
    "missing_token_ids",
    "token_count_mismatch",
    "token_mismatch",
    "empty_content",
    "empty_reasoning",
    "unterminated_reasoning",
    "truncated",
    "duplicate",
)
# Defects that make a sample unusable for training whatever the thresholds say.
EXCLUDING = frozenset({"missing_token_ids", "token_count_mismatch", "token_mismatch", "duplicate"})
