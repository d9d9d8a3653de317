"""Generation in shards (generate/run.py: Shard; generate/join.py): which conversations a
shard takes, which endpoints it sends to, and the join that refuses a wrong set of shards."""

import json

import pytest

from eagleflow.common.atomic import write_json, write_jsonl
from eagleflow.common.replies import read_replies, write_replies
from eagleflow.generate.join import join_shards
from eagleflow.generate.run import Shard

IDS = [f"conv-{i}" for i in range(2000)]


@pytest.mark.parametrize("count", [1, 2, 3, 16])
def test_every_conversation_is_in_exactly_one_shard_and_adding_prompts_moves_none(count):
    shards = [Shard(i, count) for i in range(count)]
    owner = {}
    for cid in IDS:
        (taker,) = [s for s in shards if s.takes(cid)]
        owner[cid] = taker
    sizes = [sum(1 for s in owner.values() if s == shard) for shard in shards]
    assert min(sizes) > 0.7 * len(IDS) / count  # spread, not piled on one
    more = IDS + [f"new-{i}" for i in range(500)]
    assert all(next(s for s in shards if s.takes(cid)) == owner[cid] for cid in more[: len(IDS)])


def test_shard_names_round_trip_and_bad_ones_are_refused():
    assert Shard.parse("2-of-5") == Shard(2, 5) and Shard(2, 5).name == "2-of-5"
    for bad in ("5-of-5", "1of2", "-1-of-2", "0-of-0"):
        with pytest.raises(ValueError, match="not a shard name"):
            Shard.parse(bad)


def test_each_shard_sends_to_its_own_endpoints():
    four = ["http://a", "http://b", "http://c", "http://d"]
    assert [Shard(i, 2).endpoints(four) for i in range(2)] == [["http://a", "http://c"], ["http://b", "http://d"]]
    assert [Shard(i, 3).endpoints(four[:2]) for i in range(3)] == ["http://a", "http://b", "http://a"]
    assert Shard(1, 2).endpoints("http://one") == "http://one" and Shard(0, 2).endpoints(None) is None


def rows(prompt_id: str, turns: int) -> list[dict]:
    return [
        {
            "id": f"{prompt_id}#t{t}",
            "prompt_id": prompt_id,
            "turn": t,
            "category": None,
            "key": f"{prompt_id}-{t}",
            "request": {"t": t},
            "response": {"r": t},
            "error": None,
            "attempts": None,
        }
        for t in range(turns)
    ]


def shard_files(tmp_path, parts: dict[str, list[str]]):
    replies, stats = [], []
    for name, ids in parts.items():
        r, s = tmp_path / f"{name}.parquet", tmp_path / f"{name}.json"
        write_replies(r, [row for i in ids for row in rows(i, 2)])
        write_json(s, {"conversations": len(ids), "requests": 2 * len(ids), "sent": len(ids), "reused": len(ids)})
        replies.append(str(r))
        stats.append(str(s))
    return replies, stats


def test_the_join_puts_rows_back_in_the_prompt_files_order_and_sums_the_stats(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    write_jsonl(prompts, [{"id": i, "turns": ["q", "q"]} for i in ("c", "a", "d", "b")])
    # Each shard's rows in the file's order, as a shard writes them; the join interleaves them.
    replies, stats = shard_files(tmp_path, {"0-of-2": ["a", "b"], "1-of-2": ["c", "d"]})
    out = str(tmp_path / "replies.parquet")
    join_shards(str(prompts), replies, stats, out, str(tmp_path / "stats.json"), batch_rows=3)
    joined = [r["id"] for r in read_replies(tmp_path / "replies.parquet")]
    assert joined == ["c#t0", "c#t1", "a#t0", "a#t1", "d#t0", "d#t1", "b#t0", "b#t1"]
    total = json.loads((tmp_path / "stats.json").read_text())
    assert (total["conversations"], total["requests"], total["sent"], total["reused"]) == (4, 8, 4, 4)
    assert len(total["shards"]) == 2


@pytest.mark.parametrize(
    ("parts", "error"),
    [
        ({"0-of-2": ["a", "b"], "1-of-2": ["b", "c"]}, "conversation b is in two shards"),
        ({"0-of-2": ["a"], "1-of-2": ["c"]}, "1 conversations are in no shard"),
        ({"0-of-2": ["b", "a"], "1-of-2": ["c"]}, "not in the prompt file's order at a#t0"),
        ({"0-of-2": ["a", "b", "z"], "1-of-2": ["c"]}, "conversation z is not in the prompt file"),
    ],
)
def test_the_join_refuses_a_conversation_twice_or_missing(tmp_path, parts, error):
    prompts = tmp_path / "prompts.jsonl"
    write_jsonl(prompts, [{"id": i, "turns": ["q"]} for i in "abc"])
    replies, stats = shard_files(tmp_path, parts)
    with pytest.raises(ValueError, match=error):
        join_shards(str(prompts), replies, stats, str(tmp_path / "r.parquet"), str(tmp_path / "s.json"))
    assert not (tmp_path / "r.parquet").exists()
