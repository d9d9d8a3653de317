"""Prompts the verifier writes (prompts.template, prompts.written) and what the prompt set is
cleaned of and mixed from (prompts.filters, prompts.run): pure parts, and the walk against a
store and a scripted client (the real vLLM run is in the finished test run)."""

import asyncio
import json
import re

import jinja2
import pytest

from eagleflow.generate.run import Requests, walk_conversation
from eagleflow.prompts.config import FilterConfig, PromptsConfig, Weights, WrittenConfig
from eagleflow.prompts.filters import BenchmarkIndex, apply_filters, text_score
from eagleflow.prompts.load import normalise
from eagleflow.prompts.run import benchmark_turns, mix, run_prompts
from eagleflow.prompts.template import TemplateError, UserTurn
from eagleflow.prompts.written import Replies, completion_payload, write_conversation
from eagleflow.runtime.answers import Counts, Missing, StoreFront
from eagleflow.runtime.response_store import ResponseStore

# The chat templates of the verifier families eagleflow supports, reduced to their turn markup.
SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
QWEN3_THINKING = (
    "{% for m in messages %}{% if m.role == 'system' %}<|im_start|>system\n{{ m.content }}<|im_end|>\n"
    "{% elif m.role == 'user' %}<|im_start|>user\n{{ m.content }}<|im_end|>\n"
    "{% else %}<|im_start|>assistant\n{% if m.reasoning %}<think>\n{{ m.reasoning }}\n</think>\n\n{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
KIMI_K2 = (
    "{% if messages[0].role != 'system' %}<|im_system|>system<|im_middle|>You are Kimi, an AI assistant "
    "created by Moonshot AI.<|im_end|>{% endif %}{% for m in messages %}"
    "{% if m.role == 'system' %}<|im_system|>system<|im_middle|>{{ m.content }}<|im_end|>"
    "{% elif m.role == 'user' %}<|im_user|>user<|im_middle|>{{ m.content }}<|im_end|>"
    "{% else %}<|im_assistant|>assistant<|im_middle|>{{ m.content }}<|im_end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
)
DEEPSEEK_V3 = (
    "<｜begin▁of▁sentence｜>{% for m in messages %}{% if m.role == 'system' %}{{ m.content }}{% endif %}"
    "{% endfor %}{% for m in messages %}{% if m.role == 'user' %}<｜User｜>{{ m.content }}"
    "{% elif m.role == 'assistant' %}<｜Assistant｜>{{ m.content }}<｜end▁of▁sentence｜>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)
# A template whose turns end in plain text: no token to stop a written turn at.
PLAIN = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant:"
    "{% endif %}"
)
# One that rewrites the user's text, and one whose system prompt quotes the last user turn.
REWRITES = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | upper }}<|im_end|>\n{% endfor %}"
QUOTES = (
    "<|im_start|>system\nTopic: {{ messages[-1].content[:4] }}<|im_end|>\n"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
)
SPECIAL = re.compile(r"<\|[^|]*\|>|<｜[^｜]*｜>|.", re.DOTALL)


def tokens(text: str) -> list[str]:
    return SPECIAL.findall(text)


def user_turn(template: str, system: str | None = None, name: str = "test-verifier") -> UserTurn:
    compiled = jinja2.Environment().from_string(template)
    vocab: dict[str, int] = {}

    def encode(text: str) -> list[int]:
        return [vocab.setdefault(t, len(vocab)) for t in tokens(text)]

    def render(messages, add_generation_prompt):
        return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt)

    def special_ids():
        return {i for t, i in vocab.items() if len(t) > 1}

    class Specials(set):  # the ids of the specials seen so far, when asked
        def __contains__(self, i):
            return i in special_ids()

    inverse = lambda ids: "".join({i: t for t, i in vocab.items()}[i] for i in ids)  # noqa: E731
    return UserTurn.find(name, render, encode, Specials(), inverse, system)


SMOLLM2_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
KIMI_SYSTEM = "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"


@pytest.mark.parametrize(
    ("template", "before", "header", "end"),
    [
        (SMOLLM2, SMOLLM2_SYSTEM, "<|im_start|>user\n", "<|im_end|>"),
        (QWEN3_THINKING, "", "<|im_start|>user\n", "<|im_end|>"),
        (KIMI_K2, KIMI_SYSTEM, "<|im_user|>user<|im_middle|>", "<|im_end|>"),
        # DeepSeek-V3 has no end-of-user token: its user turn ends where the assistant's begins.
        (DEEPSEEK_V3, "<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"),
    ],
    ids=["smollm2", "qwen3-thinking", "kimi-k2", "deepseek-v3"],
)
def test_the_user_turn_opening_and_end_of_each_supported_template(template, before, header, end):
    """`before`: what the template puts ahead of the first turn (a default system prompt, BOS);
    `header`: its markup that opens a user turn."""
    turn = user_turn(template)
    assert turn.opening([]) == before + header
    assert turn.end_token == end
    later = turn.opening([{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}])
    assert later.startswith(before + header + "Hi.") and "Hello." in later
    assert later.endswith(header) and later.count(header) == 2


def test_a_system_prompt_opens_the_written_conversation():
    turn = user_turn(SMOLLM2, system="Ask about gardening.")
    assert turn.opening([{"role": "system", "content": "Ask about gardening."}]) == (
        "<|im_start|>system\nAsk about gardening.<|im_end|>\n<|im_start|>user\n"
    )


@pytest.mark.parametrize(
    ("template", "why"),
    [
        (PLAIN, "does not begin with a special token"),
        (REWRITES, "does not render a user's text verbatim"),
        (QUOTES, "depends on what the user writes"),
    ],
    ids=["plain-text-turns", "rewrites-the-text", "quotes-the-text"],
)
def test_a_template_without_a_clean_user_turn_is_refused_naming_the_verifier(template, why):
    with pytest.raises(TemplateError, match=f"verifier my-verifier: .*{why}"):
        user_turn(template, name="my-verifier")


def written_config(**over) -> WrittenConfig:
    settings = dict(
        count=3,
        turns=2,
        system=None,
        hints=(),
        hint_prompt="The user asks you about {hint}.",
        temperature=1.0,
        top_p=0.95,
        max_tokens=32,
        seed=0,
    )
    return WrittenConfig(**(settings | over))


class ScriptedServer:
    """Answers chat and completion requests with canned text; records what it was asked."""

    def __init__(self, cut_turn: int | None = None):
        self.asked: list[dict] = []
        self.cut_turn = cut_turn

    async def completion(self, payload):
        self.asked.append(payload)
        n = sum(1 for p in self.asked if "prompt" in p)
        cut = self.cut_turn is not None and n == self.cut_turn
        return {"choices": [{"text": f" Question number {n}? ", "finish_reason": "length" if cut else "stop"}]}

    async def chat(self, payload):
        self.asked.append(payload)
        return {"choices": [{"message": {"role": "assistant", "content": f"Answer {len(self.asked)}."}}]}


REPLIES = Replies(model="verifier", sampling={"max_tokens": 16, "temperature": 0.0, "seed": 0}, chat_template_kwargs={})


def write(index, cfg, store, server, counts=None):
    turn = user_turn(SMOLLM2)
    front = StoreFront(store, {"verifier": "v"}, counts or Counts(), server)
    encode = lambda text: [len(t) for t in tokens(text)]  # noqa: E731
    return asyncio.run(write_conversation(index, cfg, turn, encode, "verifier", REPLIES, front))


def test_a_written_conversation_alternates_written_turns_and_generates_own_replies(tmp_path):
    cfg = written_config()
    server = ScriptedServer()
    with ResponseStore(tmp_path / "store.sqlite") as store:
        row = write(0, cfg, store, server)
        assert row["turns"] == ["Question number 1?", "Question number 2?"] and row["ended"] == [True, True]
        assert [("prompt" in p) for p in server.asked] == [True, False, True]
        assert server.asked[0]["stop_token_ids"] == [user_turn(SMOLLM2).end_token_id]
        # generate, walking the written conversation, finds the reply to its first turn in the store.
        prompt = {**normalise(row, "written"), "source": "written"}
        front = StoreFront(store, {"verifier": "v"}, Counts(), None)
        requests = Requests(REPLIES.model, REPLIES.sampling, REPLIES.chat_template_kwargs)
        with pytest.raises(Missing):  # its second turn's reply is generate's to ask
            asyncio.run(walk_conversation(prompt, requests, front))
        assert front.counts.reused == 1
        # A rerun asks nothing: the store answers every request.
        again = ScriptedServer()
        assert write(0, cfg, store, again) == row and again.asked == []


def test_a_turn_that_does_not_end_ends_the_conversation_marked(tmp_path):
    with ResponseStore(tmp_path / "store.sqlite") as store:
        row = write(0, written_config(turns=3), store, ScriptedServer(cut_turn=2))
    assert row["ended"] == [True, False] and len(row["turns"]) == 2


def test_each_written_turn_has_its_own_seed_and_the_same_seed_gives_the_same_requests():
    cfg = written_config()
    a = completion_payload([1, 2], "w0-000000", 0, model="m", cfg=cfg, end_token_id=7)
    b = completion_payload([1, 2], "w0-000001", 0, model="m", cfg=cfg, end_token_id=7)
    assert a["seed"] != b["seed"]
    assert a == completion_payload([1, 2], "w0-000000", 0, model="m", cfg=cfg, end_token_id=7)
    reseeded = completion_payload([1, 2], "w0-000000", 0, model="m", cfg=written_config(seed=1), end_token_id=7)
    assert a["seed"] != reseeded["seed"]


def test_hints_go_into_the_writing_context_only(tmp_path):
    cfg = written_config(turns=1, hints=("gardening", "tax law"))
    server = ScriptedServer()
    with ResponseStore(tmp_path / "store.sqlite") as store:
        rows = [write(i, cfg, store, server) for i in range(2)]
    assert [r["category"] for r in rows] == ["gardening", "tax law"] and rows[0]["system"] is None
    decoded = [p["prompt"] for p in server.asked]
    assert decoded[0] != decoded[1]  # different writing contexts


FILTERS = FilterConfig(min_chars=8, max_chars=1000, min_text_score=0.5, near_duplicate=0.7, benchmark_overlap=0.5)
DISTINCT = [
    "How do I repot a fiddle-leaf fig without damaging its roots?",
    "Explain the difference between a Roth IRA and a traditional IRA for a first-time saver.",
    "Write a short poem about the first snowfall in a mountain village.",
    "What are good strategies for learning a second language as an adult with a full-time job?",
    "Give me a recipe for a vegetarian lasagna that can be frozen and reheated.",
    "Why does the moon always show the same face to the Earth?",
    "Can you help me draft an email asking my landlord to fix a leaking kitchen faucet?",
    "What should I pack for a week-long hiking trip in the Scottish Highlands in October?",
]


VERBS = ("How would you explain", "What is the history of", "Why do people argue about", "Can you summarise")
THINGS = ("tidal energy", "medieval guilds", "sourdough starters", "jazz harmony", "urban beekeeping")


def rows(texts, source="written", prefix="w"):
    return [{"id": f"{prefix}{i}", "system": None, "turns": [t], "source": source} for i, t in enumerate(texts)]


def test_planted_near_duplicates_are_removed_and_distinct_prompts_kept():
    planted = [
        "how do I repot a fiddle leaf fig without damaging its roots",  # case and punctuation
        "Explain the difference between a Roth IRA and a traditional IRA for a first-time investor.",
        "Write a short poem about the first snowfall in a quiet mountain village.",
    ]
    kept, removed = apply_filters(rows(DISTINCT) + rows(planted, prefix="p"), FILTERS, None)
    assert [p["turns"][0] for p in kept] == DISTINCT
    reasons = {r["prompt"]["id"]: r["reason"] for r in removed}
    assert reasons == {"p0": "duplicate", "p1": "near_duplicate", "p2": "near_duplicate"}
    assert all(r["detail"] for r in removed)


def test_planted_benchmark_items_are_dropped_and_counted():
    turns = benchmark_turns([{"name": "mt_bench"}, {"name": "humaneval"}])
    assert {t.split("-")[0] for t, _ in turns} == {"mt_bench", "humaneval"}
    mt_bench_first = dict(turns)["mt_bench-81#t0"]
    humaneval_stub = dict(turns)["humaneval-0#t0"]
    edited = mt_bench_first.replace("Compose", "Write")
    index = BenchmarkIndex(turns, FILTERS.benchmark_overlap)
    planted = rows([mt_bench_first, edited, humaneval_stub], prefix="b")
    kept, removed = apply_filters(rows(DISTINCT) + planted, FILTERS, index)
    assert len(kept) == len(DISTINCT)
    assert {r["prompt"]["id"]: r["reason"] for r in removed} == dict.fromkeys(["b0", "b1", "b2"], "benchmark")
    assert "mt_bench-81#t0" in removed[0]["detail"] and "humaneval-0#t0" in removed[2]["detail"]


def test_unended_short_long_and_garbled_turns_are_removed_with_their_reason():
    bad = [
        {"id": "cut", "system": None, "turns": ["A question that never", "ended"], "ended": [True, False]},
        {"id": "err", "system": None, "turns": [], "ended": [], "error": "HTTP 500"},
        {"id": "short", "system": None, "turns": ["Hi?"]},
        {"id": "long", "system": None, "turns": [" ".join(f"word{i}" for i in range(200))]},
        {"id": "soup", "system": None, "turns": ["?!?! @@ ## $$ %% ^^ && ** (( ))"]},
        {"id": "loop", "system": None, "turns": ["tell me more " * 20]},
    ]
    kept, removed = apply_filters(rows(DISTINCT[:2]) + [{**b, "source": "written"} for b in bad], FILTERS, None)
    assert len(kept) == 2
    assert {r["prompt"]["id"]: r["reason"] for r in removed} == {
        "cut": "not_ended",
        "err": "not_ended",
        "short": "length",
        "long": "length",
        "soup": "not_text",
        "loop": "not_text",
    }
    assert text_score("def add(a, b):\n    return a + b") == 1.0
    assert text_score("Solve for x: 10x + 21 = 391.") == 1.0


def test_mixing_takes_each_sources_share_deterministically():
    file_rows = rows([f"File question {i} about topic {i * 7}" for i in range(100)], source="file", prefix="f")
    written = rows([f"Written question {i} about thing {i * 3}" for i in range(30)], prefix="w")
    mixed = mix({"file": file_rows, "written": written}, {"file": 1.0, "written": 1.0}, seed=0)
    assert sum(p["source"] == "file" for p in mixed) == 30 and sum(p["source"] == "written" for p in mixed) == 30
    assert mixed == mix({"file": file_rows, "written": written}, {"file": 1.0, "written": 1.0}, seed=0)
    assert mixed != mix({"file": file_rows, "written": written}, {"file": 1.0, "written": 1.0}, seed=1)
    quarter = mix({"file": file_rows, "written": written}, {"file": 3.0, "written": 1.0}, seed=0)
    assert (sum(p["source"] == "file" for p in quarter), sum(p["source"] == "written" for p in quarter)) == (90, 30)
    # The sources are interleaved, so truncating the set keeps the shares all along it.
    for n in (8, 20, 40):
        assert abs(sum(p["source"] == "written" for p in mixed[:n]) - n / 2) <= 1
        assert abs(sum(p["source"] == "written" for p in quarter[:n]) - n / 4) <= 1
    assert mix({"file": file_rows, "written": written}, {"file": 1.0, "written": 0.0}, seed=0) == file_rows


def test_the_prompt_set_is_the_same_for_the_same_seed_and_described(tmp_path):
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps({"id": f"f{i}", "prompt": t}) + "\n" for i, t in enumerate(DISTINCT * 3)))
    written = tmp_path / "written.jsonl"
    texts = [f"{verb} {thing}?" for verb in VERBS for thing in THINGS][:20]
    written.write_text(
        "".join(json.dumps({**r, "ended": [True], "error": None, "category": "written"}) + "\n" for r in rows(texts))
    )
    cfg = PromptsConfig(str(source), 0.2, 0, None, None, written_config(count=20, turns=1), Weights(1.0, 1.0), FILTERS)

    def build(out):
        out.mkdir()
        run_prompts(str(source), str(written), *(str(out / n) for n in ("t.jsonl", "e.jsonl", "s.json")), cfg, [])
        return [(out / n).read_text() for n in ("t.jsonl", "e.jsonl")], json.loads((out / "s.json").read_text())

    first, stats = build(tmp_path / "a")
    assert build(tmp_path / "b")[0] == first
    assert stats["sources"]["file"]["loaded"] == 24 and stats["sources"]["file"]["kept"] == len(DISTINCT)
    assert stats["filters"]["removed"]["duplicate"]["count"] == 16
    assert stats["sources"]["written"]["train"] + stats["sources"]["written"]["eval"] == len(DISTINCT)
    assert stats["train"]["written"]["examples"] and stats["train"]["file"]["distinct_1"] > 0


def test_prune_keeps_the_entries_written_prompts_used(tmp_path):
    from eagleflow.common.atomic import write_jsonl
    from eagleflow.generate.__main__ import main as store_cli

    with ResponseStore(tmp_path / "store.sqlite") as store:
        row = write(0, written_config(turns=2), store, ScriptedServer())
        store.put("an-old-request", {"old": True}, {"choices": []})
        assert len(store) == 4
    write_jsonl(tmp_path / "written.jsonl", [row])
    assert store_cli(["prune", str(tmp_path / "store.sqlite"), "--keep", str(tmp_path / "written.jsonl")]) == 0
    with ResponseStore(tmp_path / "store.sqlite") as store:
        assert store.keys() == set(row["keys"]) and len(row["keys"]) == 3
