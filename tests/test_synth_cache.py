import json

from workflow_scripts.synth.generate import SampleCache


def rec(cid, text="réponse ✓"):
    return {"conversation_id": cid, "samples": [{"id": f"{cid}#t0", "content": text}], "error": None}


def test_cache_resumes_and_drops_a_torn_last_line(tmp_path):
    cache = SampleCache(tmp_path, "fp1")
    cache.add(rec("a"))
    cache.add(rec("b"))
    cache.close()
    with open(cache.path, "ab") as fh:  # a job killed mid-write
        fh.write(json.dumps(rec("c")).encode()[:25])
    resumed = SampleCache(tmp_path, "fp1")
    assert sorted(resumed.records) == ["a", "b"]
    resumed.add(rec("c"))
    resumed.close()
    lines = cache.path.read_text(encoding="utf-8").splitlines()
    assert [json.loads(line)["conversation_id"] for line in lines] == ["a", "b", "c"]


def test_cache_with_another_fingerprint_is_discarded(tmp_path):
    old = SampleCache(tmp_path, "old")
    old.add(rec("a"))
    old.close()
    new = SampleCache(tmp_path, "new")
    assert new.records == {}
    assert not (tmp_path / "old.jsonl").exists()
    new.close()
