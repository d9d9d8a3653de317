"""A stage's code key, as its rules' `code` param holds it (rules/common.smk: code).

The key is the fingerprint of the stage's entry and every module it imports (common.fingerprint).
An edit that changes code but no byte the stage writes, made in a module that also holds result
code, would still re-key all the stage made: for hidden_states, every stored sample (the key is
in each sample's). SAME_BYTES names such edits: the fingerprint after the edit maps to the one
before it, so what was made before stays current. Each entry says what the edit was and which
test shows the bytes unchanged; the next edit changes the fingerprint again and restales as any
edit does. Never for an edit whose effect on the bytes is not shown.
"""

from __future__ import annotations

SAME_BYTES: dict[str, dict[str, str]] = {
    "hidden_states": {
        # storage.states, the per-sample store in a bucket (runtime/state_store.py): the job
        # picks its store and asks it for the digests. On a filesystem the manifests and files
        # are byte for byte those of before; in a bucket the files are the filesystem's, digest
        # for digest (tests/integration/test_object_store.py).
        "9ad5a3b42719474e": "b30754698717abae",
    },
    # The response store's modules renamed for what they hold (runtime/store.py ->
    # runtime/response_store.py, runtime/store_or_server.py -> runtime/answers.py): run-only
    # code, in no fingerprint; the importers' only change is the name they import.
    "generate": {"b75d829616a56538": "46af5d508857e1db"},
    "write_prompts": {"7142f48b46f49941": "697a417ceb6cbfe5"},
    # storage.checkpoints (runtime/checkpoint_mirror.py, hooked in train/loop.py): the trainer copies each
    # checkpoint to a bucket and fetches the newest back where its node lacks it; without the
    # key nothing runs that did not. A draft resumed from the bucket's checkpoint is the
    # filesystem's uninterrupted draft, tensor for tensor
    # (tests/integration/test_object_storage_run.py).
    "train": {"7c695abb444fbe43": "f23871a5b3405387"},
}


def code_key(script: str, fingerprint: str) -> str:
    """`fingerprint` of `script`'s code, or the one it is declared byte-equivalent to."""
    return SAME_BYTES.get(script, {}).get(fingerprint, fingerprint)
