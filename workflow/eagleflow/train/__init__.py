"""train: the project's own EAGLE-3 training loop around speculators' Eagle3DraftModel."""
