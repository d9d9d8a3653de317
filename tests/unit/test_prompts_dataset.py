import json

import pytest

from eagleflow.dataset import build_rows, is_eval
from eagleflow.prompts.load import load_prompts, normalise, split_prompts


def test_normalise_accepts_turns_prompt_and_messages():
    a = normalise({"id": "a", "turns": ["hi", "more"]}, "x")
    b = normalise({"prompt": "hi"}, "x")
    c = normalise(
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "old reply"},
                {"role": "user", "content": "more"},
            ]
        },
        "x",
    )
    assert a["turns"] == ["hi", "more"] and a["id"] == "a"
    assert b["turns"] == ["hi"] and b["id"].startswith("p-")
    assert c["turns"] == ["hi", "more"] and c["system"] == "be brief"


def test_normalise_rejects_bad_rows_with_location():
    with pytest.raises(ValueError, match="prompts.jsonl row 3"):
        normalise({"text": "hi"}, "prompts.jsonl row 3")
    with pytest.raises(ValueError, match="non-empty"):
        normalise({"turns": ["ok", " "]}, "r")


def test_split_is_disjoint_deterministic_and_deduplicated():
    prompts = [normalise({"id": f"p{i}", "prompt": f"question {i}"}, "r") for i in range(200)]
    prompts.append(normalise({"id": "dup", "prompt": "question 5"}, "r"))
    train, evals = split_prompts(prompts, 0.2, seed=0)
    assert len(train) + len(evals) == 200
    assert {p["id"] for p in train}.isdisjoint({p["id"] for p in evals})
    assert {p["turns"][0] for p in train}.isdisjoint({p["turns"][0] for p in evals})
    assert 20 <= len(evals) <= 60
    assert split_prompts(prompts, 0.2, seed=0) == (train, evals)
    assert split_prompts(prompts, 0.2, seed=1) != (train, evals)


def test_duplicate_id_for_different_conversations_is_an_error():
    with pytest.raises(ValueError, match="used by two"):
        split_prompts([normalise({"id": "x", "prompt": "a"}, "r"), normalise({"id": "x", "prompt": "b"}, "r")], 0.5)


def test_shipped_prompt_set_is_diverse_and_splits(repo):
    prompts = load_prompts(repo / "config/prompts/demo.jsonl")
    categories = {p["category"] for p in prompts}
    assert {"chat", "code", "math", "reasoning", "multi-turn"} <= categories
    assert any(len(p["turns"]) > 1 for p in prompts)
    train, evals = split_prompts(prompts, 0.1)
    assert len(evals) >= 20 and len(train) >= 250


def test_load_prompts_names_the_bad_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "ok"}) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"p.jsonl:2"):
        load_prompts(path)


def sample(i, defects=()):
    return {
        "id": f"p{i}#t0",
        "prompt_id": f"p{i}",
        "prompt_token_ids": [1, 2, 3],
        "completion_token_ids": [4, 5],
        "defects": list(defects),
    }


def test_build_rows_masks_prompt_and_skips_excluded():
    rows = build_rows(
        [sample(0), sample(1, ["missing_token_ids"]), sample(2, ["truncated"])], 1024, frozenset({"missing_token_ids"})
    )
    assert [r["id"] for r in rows] == ["p0#t0", "p2#t0"]
    assert rows[0]["input_ids"] == [1, 2, 3, 4, 5] and rows[0]["loss_mask"] == [0, 0, 0, 1, 1]
    assert rows[0]["num_loss_tokens"] == 2


def test_truncation_that_leaves_no_generated_token_drops_the_sample():
    assert build_rows([sample(0)], 3, frozenset()) == []


def test_eval_split_keeps_conversations_together():
    assert is_eval("conv-1", 0.5, 0) == is_eval("conv-1", 0.5, 0)
    picks = [is_eval(f"c{i}", 0.1, 0) for i in range(1000)]
    assert 50 < sum(picks) < 150
