from eagleflow.dataset import gate_failures
from eagleflow.synth.quality import quality_report


def sample(i, defects=(), completion=(4, 5)):
    return {
        "id": f"p{i}#t0",
        "prompt_token_ids": [1, 2],
        "completion_token_ids": list(completion),
        "defects": list(defects),
    }


def test_counts_fractions_and_examples():
    samples = [
        sample(0, ["empty_content"]),
        sample(1, completion=(6,)),
        sample(2, ["truncated", "empty_content"], completion=(7,)),
    ]
    report = quality_report(samples, errors=[{"conversation_id": "p9"}], num_prompts=4)
    assert report["counts"]["empty_content"] == 2
    assert report["fractions"]["truncated"] == 1 / 3
    assert report["examples"]["empty_content"] == ["p0#t0", "p2#t0"]
    assert report["request_errors"] == 1 and report["request_error_fraction"] == 0.25


def test_identical_token_streams_are_duplicates():
    samples = [sample(0), sample(1), sample(2, completion=(9,))]
    report = quality_report(samples, [], num_prompts=3)
    assert report["counts"]["duplicate"] == 1
    assert report["examples"]["duplicate"] == ["p1#t0"]


def test_gate_names_defect_count_and_examples():
    samples = [sample(i, ["empty_content"] if i < 3 else [], completion=(i,)) for i in range(10)]
    report = quality_report(samples, [], num_prompts=10)
    failures = gate_failures(report, {"empty_content": 0.2, "duplicate": 0.0})
    assert len(failures) == 1
    assert "empty_content: 3 samples (30.0%)" in failures[0]
    assert "p0#t0" in failures[0]
    assert gate_failures(report, {"empty_content": 0.3}) == []
