import pytest

from eagleflow.dataset import sequence_of
from eagleflow.synth.assemble import parse_completion, reasoning_of


def body(message, token_ids=(5, 6, 2), prompt_ids=(1, 2, 3), finish="stop", usage=True):
    b = {
        "model": "verifier",
        "choices": [
            {
                "message": message,
                "finish_reason": finish,
                "token_ids": list(token_ids) if token_ids is not None else None,
            }
        ],
    }
    if prompt_ids is not None:
        b["prompt_token_ids"] = list(prompt_ids)
    if usage:
        b["usage"] = {"prompt_tokens": len(prompt_ids or ()), "completion_tokens": len(token_ids or ())}
    return b


@pytest.mark.parametrize(
    "message, expected",
    [
        ({"content": "a", "reasoning": "think"}, "think"),
        ({"content": "a", "reasoning_content": "old"}, "old"),
        ({"content": "a", "reasoning": None, "reasoning_content": "old"}, "old"),
        ({"content": "a"}, None),
    ],
)
def test_reasoning_read_from_either_field(message, expected):
    assert reasoning_of(message) == expected


def test_clean_sample_has_no_defects():
    c = parse_completion(body({"content": "hello"}), expect_reasoning=False)
    assert c.defects == []
    assert c.prompt_token_ids == [1, 2, 3]
    assert c.completion_token_ids == [5, 6, 2]


def test_reasoning_expected_but_missing():
    c = parse_completion(body({"content": "hello"}), expect_reasoning=True)
    assert c.defects == ["empty_reasoning"]


def test_reasoning_without_content_is_unterminated_unless_truncated():
    c = parse_completion(body({"content": None, "reasoning": "hmm"}), expect_reasoning=True)
    assert "unterminated_reasoning" in c.defects and "empty_content" in c.defects
    t = parse_completion(body({"content": None, "reasoning": "hmm"}, finish="length"), expect_reasoning=True)
    assert "unterminated_reasoning" not in t.defects and "truncated" in t.defects


def test_content_with_an_unterminated_think_block():
    markers = ("<think>", "</think>")
    c = parse_completion(
        body({"content": "<think>let me see, the answer"}), expect_reasoning=True, think_markers=markers
    )
    assert "unterminated_reasoning" in c.defects
    ok = parse_completion(
        body({"content": "plain answer", "reasoning": "thought"}), expect_reasoning=True, think_markers=markers
    )
    assert ok.defects == []


def test_missing_token_ids_is_a_defect():
    c = parse_completion(body({"content": "x"}, token_ids=None, usage=False), expect_reasoning=False)
    assert c.defects == ["missing_token_ids"]


def test_token_count_mismatch():
    b = body({"content": "x"})
    b["usage"]["completion_tokens"] = 7
    assert "token_count_mismatch" in parse_completion(b, expect_reasoning=False).defects


def test_sequence_masks_only_generated_tokens():
    ids, mask = sequence_of([1, 2, 3], [7, 8])
    assert ids == [1, 2, 3, 7, 8]
    assert mask == [0, 0, 0, 1, 1]
    ids, mask = sequence_of([1, 2, 3], [7, 8], max_len=4)
    assert ids == [1, 2, 3, 7] and mask == [0, 0, 0, 1]


from eagleflow.synth.assemble import Completion, StreamTokens, rebuild_completion_ids, verify_stream  # noqa: E402

THINK = StreamTokens(eos_id=2, think_start_id=3, think_end_id=4)


def encode(text):
    return [ord(ch) for ch in text]


@pytest.mark.parametrize(
    "prompt_tail, reasoning, content, finish, expected",
    [
        ([3], "ab", "cd", "stop", [97, 98, 4, 99, 100, 2]),  # template opened <think>
        ([9], "ab", "cd", "stop", [3, 97, 98, 4, 99, 100, 2]),  # the model opened it
        ([3], "ab", None, "length", [97, 98]),  # truncated while thinking
        ([3], "ab", None, "stop", [97, 98, 4, 2]),  # closed, then stopped with no answer
        ([3], None, "cd", "stop", [4, 99, 100, 2]),  # an empty think block
        ([9], None, "cd", "length", [99, 100]),  # no thinking at all
    ],
)
def test_rebuild_places_think_markers_as_single_tokens(prompt_tail, reasoning, content, finish, expected):
    assert rebuild_completion_ids(encode, [1, *prompt_tail], reasoning, content, finish, THINK) == expected


def test_rebuild_without_think_markers():
    plain = StreamTokens(eos_id=2)
    assert rebuild_completion_ids(encode, [1], None, "hi", "stop", plain) == [104, 105, 2]


def completion(prompt, comp):
    return Completion(
        None, "x", "stop", prompt, comp, None, None, None, None, defects=["missing_token_ids"] if comp is None else []
    )


def test_verify_fills_missing_ids_from_the_rebuild():
    c = verify_stream(completion(None, None), [1, 2], [5, 2])
    assert (c.prompt_token_ids, c.completion_token_ids, c.token_source, c.defects) == ([1, 2], [5, 2], "rebuilt", [])


def test_verify_flags_a_rebuild_that_differs_from_the_server():
    assert verify_stream(completion([1, 2], [5, 2]), [1, 2], [5, 2]).defects == []
    assert verify_stream(completion([1, 2], [5, 6, 2]), [1, 2], [5, 2]).defects == ["token_mismatch"]
