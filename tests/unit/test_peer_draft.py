"""Which of speculators' checkpoints bench/peer_draft.py exports as the peer's draft."""

import pytest

from bench.peer_draft import chosen_checkpoint


def speculators_checkpoints(root, epochs, best):
    """A save path as speculators' trainer leaves it: one directory an epoch, named by its
    number, `checkpoint_best` and `epoch<N>_end` links to them, and its own files."""
    for epoch in epochs:
        (root / str(epoch)).mkdir(parents=True)
        (root / f"epoch{epoch}_end").symlink_to(str(epoch))
    (root / "checkpoint_best").symlink_to(str(best))
    (root / "train_command.txt").write_text("speculators train ...")
    return root


def test_last_is_the_highest_epoch_by_number_and_best_is_speculators_link(tmp_path):
    root = speculators_checkpoints(tmp_path / "checkpoints", range(11), best=1)
    assert chosen_checkpoint(root, "last").resolve() == (root / "10").resolve()  # not "9", the last by name
    assert chosen_checkpoint(root, "best") == (root / "1").resolve()


def test_a_save_path_without_checkpoints_is_refused_by_name(tmp_path):
    root = tmp_path / "checkpoints"
    root.mkdir()
    (root / "train_command.txt").write_text("speculators train ...")
    for which in ("best", "last"):
        with pytest.raises(SystemExit, match="checkpoint"):
            chosen_checkpoint(root, which)
