"""The acceptance walk (common.acceptance) and the parity checks (benchmark.parity): pure parts."""

from __future__ import annotations

import random

import torch

from eagleflow.benchmark.parity_checks import (
    ParityConfig,
    check_aux_layer_ids,
    check_d2t,
    check_gaps,
    check_prompt_format,
    check_targets,
    first_difference,
)
from eagleflow.common.acceptance import (
    AcceptanceCounts,
    ContextBuckets,
    context_edges,
    every_anchor,
    generated_spans,
    visited_anchors,
    walk,
)
from eagleflow.common.exported_eval import exported_eval

VOCAB = 5


def verifier_next(context: list[int]) -> int:
    """A deterministic greedy 'verifier' over a tiny vocabulary."""
    return (sum(context) * 7 + len(context)) % VOCAB


def draft_next(context: list[int]) -> int:
    """A 'draft' that agrees with the verifier unless the context hashes badly."""
    guess = verifier_next(context)
    return guess if (sum(context[-3:]) * 13 + len(context)) % 4 else (guess + 1) % VOCAB


def speculative_decode(prompt: list[int], max_tokens: int, k: int) -> tuple[list[int], AcceptanceCounts]:
    """What vLLM does, step by step: the draft chains on its own tokens; the verifier accepts
    the matching prefix and adds its own token."""
    tokens = [*prompt, verifier_next(prompt)]
    counts = AcceptanceCounts(k)
    while len(tokens) - len(prompt) < max_tokens:
        chain = []
        for _ in range(k):
            chain.append(draft_next(tokens + chain))
        counts.drafts += 1
        for position, d in enumerate(chain):
            if d != verifier_next(tokens) or len(tokens) - len(prompt) >= max_tokens:
                break
            tokens.append(d)
            counts.accepted_per_pos[position] += 1
        if len(tokens) - len(prompt) < max_tokens:
            tokens.append(verifier_next(tokens))
    return tokens, counts


def teacher_forced_proposals(tokens: list[int], k: int) -> list[list[int]]:
    """proposals[s][i] as the TTT forward gives them: step s at anchor i sees the stream's
    tokens up to i + 1 + s (ground truth where the chain had its own tokens)."""
    return [[draft_next(tokens[: i + 2 + s]) for i in range(len(tokens) - 1)] for s in range(k)]


def test_the_walk_over_teacher_forced_proposals_counts_what_speculative_decoding_counts():
    rng = random.Random(0)
    for trial in range(40):
        k = rng.choice([1, 2, 3, 5])
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))]
        tokens, reference = speculative_decode(prompt, rng.randint(3, 60), k)
        counts = walk(tokens, len(prompt), teacher_forced_proposals(tokens, k))
        assert counts.drafts == reference.drafts, trial
        assert counts.accepted_per_pos == reference.accepted_per_pos, trial


def test_every_anchor_counts_each_output_anchor_and_the_walk_only_the_visited():
    tokens = [1, 2, 3, 4, 0, 1, 2]
    proposals = [[t for t in tokens[2:]] + [0, 0], [t for t in tokens[3:]] + [0, 0, 0]]
    # A perfect draft (it proposes the stream itself): every anchor accepts what the stream allows.
    # Anchors 1..4; each accepts min(k, tokens left after its known one): 2, 2, 2, 1.
    counts = every_anchor(tokens, 2, proposals)
    assert (counts.drafts, counts.accepted_per_pos) == (4, [4, 3])
    # vLLM visits anchor 1 (accepts 2), then 4 (accepts the 1 token left).
    visited = walk(tokens, 2, proposals)
    assert (visited.drafts, visited.accepted_per_pos) == (2, [2, 1])
    assert visited.summary()["mean_acceptance_length"] == 2.5


def test_context_buckets_sum_to_the_walks_totals_and_hold_each_draft_where_it_was_proposed():
    rng = random.Random(1)
    edges = context_edges(40, first=8)
    assert edges == [0, 8, 16, 32, 64]
    every_stream, totals = ContextBuckets(3, edges), AcceptanceCounts(3)
    for _ in range(30):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))]
        tokens, _ = speculative_decode(prompt, rng.randint(3, 60), 3)
        proposals = teacher_forced_proposals(tokens, 3)
        buckets = ContextBuckets(3, edges)
        buckets.add_walk(tokens, len(prompt), proposals)
        counts = walk(tokens, len(prompt), proposals)
        assert (buckets.total().drafts, buckets.total().accepted_per_pos) == (counts.drafts, counts.accepted_per_pos)
        # A draft proposed at anchor i has seen i + 2 tokens: it is counted in that length's
        # bucket (the last one also for longer contexts).
        expected = [0] * (len(edges) - 1)
        for anchor, _ in visited_anchors(tokens, len(prompt), proposals):
            expected[next((b for b in range(len(expected)) if anchor + 2 < edges[b + 1]), len(expected) - 1)] += 1
        assert [r["num_drafts"] for r in buckets.rows()] == expected
        every_stream.add(buckets)
        totals.add(counts)
    assert every_stream.total().accepted_per_pos == totals.accepted_per_pos
    rows = every_stream.rows()
    assert [(r["context_from"], r["context_to"]) for r in rows] == [(0, 8), (8, 16), (16, 32), (32, 64)]
    assert sum(r["num_drafts"] for r in rows) == totals.drafts
    # Contexts past the last edge land in the last bucket (a stream longer than max_model_len's edge).
    assert ContextBuckets(3, edges).bucket_of(500) == 3


def test_a_draft_that_is_always_wrong_accepts_nothing():
    tokens = [0, 1, 2, 3, 4, 0, 1]
    wrong = [[(t + 1) % VOCAB for t in tokens[2:]] + [0, 0]] * 3
    counts = walk(tokens, 3, wrong)
    assert counts.summary()["mean_acceptance_length"] == 1.0
    assert counts.drafts == len(tokens) - 3 - 1


def config(tolerance=0.1, training_tolerance=0.3):
    return ParityConfig(
        enabled=True,
        tolerance=tolerance,
        training_tolerance=training_tolerance,
        min_target_agreement=0.9,
        on_gap="warn",
    )


def test_gaps_beyond_the_tolerances_are_findings():
    assert check_gaps(1.62, 1.64, 1.60, 1.70, config()) == []
    (serving,) = check_gaps(1.30, 1.64, 1.60, 1.70, config())
    assert serving.check == "replay_vs_vllm" and "-0.340" in serving.detail
    (training,) = check_gaps(1.60, 1.62, 1.40, 1.98, config())
    assert training.check == "training_vs_replay"
    # Serving above the replay is as suspect as below it.
    assert [f.check for f in check_gaps(1.90, 1.62, 1.60, None, config())] == ["replay_vs_vllm"]


def test_exported_layer_ids_and_d2t_are_checked_against_training():
    assert check_aux_layer_ids([2, 15, 27], [2, 15, 27]) == []
    (f,) = check_aux_layer_ids([3, 16, 28], [2, 15, 27])
    assert "[3, 16, 28]" in f.detail and "[2, 15, 27]" in f.detail
    d2t = torch.tensor([0, 3, 3, 7])
    assert check_d2t(d2t.clone(), d2t) == []
    (f,) = check_d2t(torch.tensor([0, 3, 4, 7]), d2t)
    assert "1 of them different" in f.detail
    assert check_d2t(None, d2t)[0].check == "d2t"
    # A map of another vocabulary size: named, not a broadcasting error.
    (f,) = check_d2t(torch.tensor([0, 3]), d2t)
    assert "a d2t of 2 entries; the vocab stage's map has 4" in f.detail


def test_served_prompt_tokens_must_be_what_synths_template_gives():
    expected = {"a": [1, 2, 3], "b": [4, 5]}
    same = [{"id": "a", "prompt_token_ids": [1, 2, 3]}, {"id": "b", "prompt_token_ids": [4, 5]}]
    assert check_prompt_format(same, expected) == []
    other = [{"id": "a", "prompt_token_ids": [1, 9, 3]}, {"id": "b", "prompt_token_ids": [4, 5, 6]}]
    (f,) = check_prompt_format(other, expected)
    assert f.detail.startswith("2 of 2") and "first: a, from token 1" in f.detail
    assert first_difference([1, 2], [1, 2, 3]) == 2 and first_difference([1], [1]) is None


def test_the_training_estimate_is_the_exported_drafts():
    rows = [
        {"split": "train", "loss": 0.1},
        {"split": "eval", "loss": 2.0, "estimated_acceptance_length": 1.5},
        {"split": "eval", "loss": 1.0, "estimated_acceptance_length": 1.9},
        {"split": "eval", "loss": 1.2, "estimated_acceptance_length": 1.95},
    ]
    assert exported_eval(rows)["estimated_acceptance_length"] == 1.9
    assert exported_eval([]) == {}


def test_training_targets_that_are_not_the_verifiers_tokens_are_a_finding_on_greedy_data():
    assert check_targets(0.99, True, config()) == []
    assert check_targets(None, True, config()) == []
    (f,) = check_targets(0.2, True, config())
    assert f.check == "training_targets" and "20.0%" in f.detail
    # Sampled data: the next token is often not the argmax; no finding.
    assert check_targets(0.2, False, config()) == []


def test_a_conversation_walks_each_assistant_turn_on_its_own():
    mask = [0, 0, 1, 1, 1, 0, 0, 1, 1, 1, 1]
    assert generated_spans(mask) == [(2, 5), (7, 11)]
    assert generated_spans([1, 1]) == [(0, 2)] and generated_spans([0]) == []
    tokens = list(range(11))
    perfect = [[t for t in tokens[2:]] + [0, 0], [t for t in tokens[3:]] + [0, 0, 0]]
    # Turn 1 (tokens 2..4): anchor 1 accepts 2 (3, 4), then nothing is left to generate.
    first = walk(tokens, 2, perfect, end=5)
    assert (first.drafts, first.accepted_per_pos) == (1, [1, 1])
    # Turn 2 (7..10): anchor 6 accepts 2 (8, 9) and the verifier adds 10: done.
    second = walk(tokens, 7, perfect, end=11)
    assert (second.drafts, second.accepted_per_pos) == (1, [1, 1])
    # Without the end, turn 1's walk would run into turn 2's tokens.
    assert walk(tokens, 2, perfect).drafts > first.drafts
