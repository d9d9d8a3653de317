"""The checkpoint mirror (runtime/checkpoint_mirror.py) against a bucket's listing, with no
server: which of the objects there make a whole checkpoint. The mirror against SeaweedFS:
tests/integration/test_object_store.py."""

from eagleflow.runtime.checkpoint_mirror import BucketCheckpoints
from eagleflow.train.checkpoint import PREFIX


def test_the_mirror_names_checkpoints_as_training_writes_them():
    assert BucketCheckpoints.STEP == PREFIX


def test_a_checkpoint_is_whole_once_its_state_is_there_and_only_a_step_directory_counts():
    mirror = BucketCheckpoints("s3://bucket/ckpt")
    listing = [
        ("step-00000004/model.safetensors", 10),
        ("step-00000004/state.json", 1),
        ("step-00000008/model.safetensors", 10),  # its state.json not yet uploaded
        ("step-00000002/state.json", 1),
        ("notes/state.json", 1),  # not a checkpoint
        ("step-00000006/sub/state.json", 1),  # not at a checkpoint's top
    ]
    assert mirror.whole(listing) == ["step-00000002", "step-00000004"]
