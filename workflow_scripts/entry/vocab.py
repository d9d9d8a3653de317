import json
from pathlib import Path

from workflow_scripts.common.smk import stage
from workflow_scripts.vocab import run_vocab

with stage(snakemake):  # noqa: F821 (injected by Snakemake)
    smk = snakemake  # noqa: F821
    verifier_config = json.loads((Path(smk.input.verifier) / "config.json").read_text())
    vocab_size = verifier_config.get("text_config", verifier_config)["vocab_size"]
    run_vocab(
        smk.input.train, smk.input.eval, vocab_size, smk.params.draft_vocab_size, smk.output.vocab_map, smk.output.stats
    )
