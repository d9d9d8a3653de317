"""The verifier's content fingerprint (common/identity.py): every byte counts, each file is read
once per change, hub cache blobs are not read at all."""

import hashlib
import json
import logging
import os
import shutil
import threading
import time

import pytest

from eagleflow.common import identity
from eagleflow.common.identity import verifier_fingerprint

BIG = 3 << 20  # a weight file larger than the 2 MiB the old head-and-tail fingerprint read whole


@pytest.fixture(autouse=True)
def digest_cache(tmp_path, monkeypatch):
    """Digests are remembered under tmp_path, never in the real home; a short racy window
    (the tests wait it out with `settle` instead of 2 s)."""
    path = tmp_path / "cache" / "file-digests.json"
    monkeypatch.setenv(identity.CACHE_ENV, str(path))
    monkeypatch.setattr(identity, "RACY_WINDOW_NS", 50_000_000)
    return path


@pytest.fixture
def hashed(monkeypatch):
    """The real paths of the files read for their digest, call by call."""
    read: list[str] = []
    real = identity.hash_file

    def counting(path, *args, **kwargs):
        read.append(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(identity, "hash_file", counting)
    return read


def settle() -> None:
    """Wait out the racy window: digests of files changed before now may be remembered."""
    time.sleep(identity.RACY_WINDOW_NS / 1e9 + 0.05)


def write_verifier(d, weights: bytes | None = None):
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"model_type": "fake"}))
    (d / "model.safetensors").write_bytes(weights if weights is not None else os.urandom(BIG))
    return d


def test_one_byte_in_the_middle_of_a_weight_file_is_another_verifier(tmp_path):
    verifier = write_verifier(tmp_path / "v")
    before = verifier_fingerprint(verifier)
    with open(verifier / "model.safetensors", "r+b") as fh:
        fh.seek(BIG // 2)
        byte = fh.read(1)
        fh.seek(BIG // 2)
        fh.write(bytes([byte[0] ^ 1]))
    assert verifier_fingerprint(verifier) != before


def test_a_copy_elsewhere_is_the_same_verifier_and_names_count(tmp_path):
    verifier = write_verifier(tmp_path / "v")
    copy = tmp_path / "elsewhere" / "copy"
    shutil.copytree(verifier, copy)
    assert verifier_fingerprint(copy) == verifier_fingerprint(verifier)
    (copy / "model.safetensors").rename(copy / "model-00001.safetensors")
    assert verifier_fingerprint(copy) != verifier_fingerprint(verifier)


def test_an_unchanged_file_is_read_once(tmp_path, hashed, digest_cache):
    verifier = write_verifier(tmp_path / "v")
    settle()
    first = verifier_fingerprint(verifier)
    assert len(hashed) == 2 and digest_cache.is_file()
    assert verifier_fingerprint(verifier) == first
    assert len(hashed) == 2, "the second call read files again"


def test_an_in_place_edit_that_puts_the_mtime_back_is_seen(tmp_path, hashed):
    verifier = write_verifier(tmp_path / "v")
    weights = verifier / "model.safetensors"
    settle()
    before = verifier_fingerprint(verifier)
    st = weights.stat()
    with open(weights, "r+b") as fh:  # same size, same inode
        fh.seek(BIG // 2)
        fh.write(b"\0" * 16 if fh.read(16) != b"\0" * 16 else b"\1" * 16)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))  # `touch -d`: the old mtime
    assert (weights.stat().st_size, weights.stat().st_mtime_ns, weights.stat().st_ino) == (
        st.st_size,
        st.st_mtime_ns,
        st.st_ino,
    )
    assert verifier_fingerprint(verifier) != before
    assert hashed.count(os.path.realpath(weights)) == 2


def test_a_file_just_written_is_not_remembered(tmp_path, hashed, monkeypatch):
    """Racy git: a file changed within the timestamp granularity after it was hashed could keep
    its stat; a digest taken right after a change is used, not remembered."""
    monkeypatch.setattr(identity, "RACY_WINDOW_NS", 2_000_000_000)
    verifier = write_verifier(tmp_path / "v")
    verifier_fingerprint(verifier)
    verifier_fingerprint(verifier)
    assert len(hashed) == 4


def test_a_hub_cache_blob_is_known_by_its_name(tmp_path, hashed):
    """`snapshots/<rev>/file` -> `../../blobs/<sha256>`: the name is the content's sha256, the
    same digest as a plain copy's, without reading the blob."""
    weights = os.urandom(BIG)
    plain = write_verifier(tmp_path / "plain", weights)
    repo = tmp_path / "hub" / "models--org--name"
    blob = repo / "blobs" / hashlib.sha256(weights).hexdigest()
    blob.parent.mkdir(parents=True)
    blob.write_bytes(weights)
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    shutil.copy(plain / "config.json", snapshot / "config.json")
    (snapshot / "model.safetensors").symlink_to(f"../../blobs/{blob.name}")
    hub_print = verifier_fingerprint(snapshot)
    assert str(blob) not in hashed and len(hashed) == 1  # config.json only
    assert hub_print == verifier_fingerprint(plain)


@pytest.mark.parametrize("name", ["ABC", "f" * 40, "0" * 63 + "g"])
def test_other_blob_names_are_read(tmp_path, hashed, name):
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    (blobs / name).write_bytes(b"weights")
    verifier = tmp_path / "v"
    verifier.mkdir()
    (verifier / "model.safetensors").symlink_to(blobs / name)
    verifier_fingerprint(verifier)
    assert hashed == [str(blobs / name)]
    # Not a `blobs` directory: a 64-hex name is read too.
    other = tmp_path / "other" / ("a" * 64)
    other.parent.mkdir()
    other.write_bytes(b"weights")
    assert identity.hub_blob_digest(str(other)) is None


@pytest.mark.parametrize("text", ["{not json", "[]", '{"version": 1}', '{"version": 99, "files": {}}'])
def test_a_corrupt_cache_is_ignored_and_rewritten(tmp_path, digest_cache, hashed, caplog, text):
    verifier = write_verifier(tmp_path / "v")
    settle()
    expected = verifier_fingerprint(verifier)
    digest_cache.write_text(text)
    with caplog.at_level(logging.WARNING, logger=identity.__name__):
        assert verifier_fingerprint(verifier) == expected
    assert str(digest_cache) in caplog.text and "corrupt" in caplog.text
    assert len(json.loads(digest_cache.read_text())["files"]) == 2
    verifier_fingerprint(verifier)
    assert len(hashed) == 4  # hashed again once, remembered since


@pytest.mark.parametrize(
    "bad", [{"stat": "garbage"}, {"stat": [1, 2]}, {"stat": ["1", "2", "3", "4"]}, {"digest": None}, {"digest": 7}]
)
def test_a_bad_entry_is_ignored(tmp_path, digest_cache, hashed, bad):
    verifier = write_verifier(tmp_path / "v")
    settle()
    verifier_fingerprint(verifier)
    data = json.loads(digest_cache.read_text())
    real = os.path.realpath(verifier / "model.safetensors")
    data["files"][real].update(bad)
    digest_cache.write_text(json.dumps(data))
    verifier_fingerprint(verifier)
    assert hashed.count(real) == 2


def test_an_empty_setting_remembers_nothing(tmp_path, monkeypatch, hashed):
    monkeypatch.setenv(identity.CACHE_ENV, "")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    verifier = write_verifier(tmp_path / "v")
    settle()
    verifier_fingerprint(verifier)
    verifier_fingerprint(verifier)
    assert len(hashed) == 4
    assert not (tmp_path / "home").exists() and not (tmp_path / "cache").exists()


def test_the_default_cache_is_under_the_users_cache_dir(tmp_path, monkeypatch):
    monkeypatch.delenv(identity.CACHE_ENV)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert identity.digest_cache_path() == tmp_path / "home" / ".cache" / "eagleflow" / "file-digests.json"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert identity.digest_cache_path() == tmp_path / "xdg" / "eagleflow" / "file-digests.json"


def test_an_unwritable_cache_is_a_warning(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(identity.CACHE_ENV, str(blocker / "file-digests.json"))  # its parent is a file
    verifier = write_verifier(tmp_path / "v")
    settle()
    with caplog.at_level(logging.WARNING, logger=identity.__name__):
        assert verifier_fingerprint(verifier)
    assert "cannot remember" in caplog.text


def test_writes_merge_and_drop_gone_paths(tmp_path, digest_cache):
    first, second = write_verifier(tmp_path / "a"), write_verifier(tmp_path / "b")
    settle()
    verifier_fingerprint(first)
    verifier_fingerprint(second)
    files = json.loads(digest_cache.read_text())["files"]
    assert {os.path.realpath(first / "config.json"), os.path.realpath(second / "config.json")} <= set(files)
    shutil.rmtree(first)
    write_verifier(tmp_path / "c")
    settle()
    verifier_fingerprint(tmp_path / "c")
    files = json.loads(digest_cache.read_text())["files"]
    assert not any(p.startswith(os.path.realpath(first) + os.sep) for p in files)
    assert os.path.realpath(second / "config.json") in files


def test_concurrent_writers_leave_a_valid_cache(tmp_path, digest_cache):
    dirs = [write_verifier(tmp_path / f"v{i}", os.urandom(1024)) for i in range(8)]
    settle()
    expected = {d: verifier_fingerprint(d) for d in dirs}
    digest_cache.unlink()
    results: dict = {}
    threads = [threading.Thread(target=lambda d=d: results.update({d: verifier_fingerprint(d)})) for d in dirs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == expected
    files = json.loads(digest_cache.read_text())["files"]
    assert files and all(identity._valid_entry(e) for e in files.values())


def test_a_file_changing_while_hashed_is_read_again(tmp_path, monkeypatch):
    path = tmp_path / "w"
    path.write_bytes(b"a" * 100)
    calls = []
    real_stream = identity.stream_into

    def writes_once(h, fh, on_block=None):
        if not calls:
            with open(path, "ab") as other:
                other.write(b"more")
        calls.append(1)
        real_stream(h, fh, on_block)

    monkeypatch.setattr(identity, "stream_into", writes_once)
    digest, _ = identity.hash_file(str(path))
    assert len(calls) == 2 and digest == "sha256:" + hashlib.sha256(b"a" * 100 + b"more").hexdigest()


def test_content_digest_is_the_whole_content(tmp_path):
    data = os.urandom(BIG)
    (tmp_path / "f").write_bytes(data)
    h = hashlib.sha256(b"\0" + data + b"\0")
    assert identity.content_digest(tmp_path / "f") == h.hexdigest()[:32]
