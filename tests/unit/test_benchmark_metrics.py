import pytest

from eagleflow.benchmark.metrics import acceptance, counter_delta, spec_decode_counters
from eagleflow.common.prometheus import parse_prometheus

METRICS = """# HELP vllm:spec_decode_num_drafts Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="verifier"} {drafts}
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="verifier"} {draft_tokens}
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="verifier"} {accepted}
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="verifier",position="0"} {p0}
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="verifier",position="1"} {p1}
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="verifier",position="2"} {p2}
vllm:spec_decode_num_drafts_created{engine="0",model_name="verifier"} 1.7e9
vllm:num_requests_running{engine="0",model_name="verifier"} 0.0
"""


def render(**kw):
    text = METRICS
    for k, v in kw.items():
        text = text.replace("{" + k + "}", str(v))
    return text


def test_parse_prometheus_keeps_labels():
    parsed = parse_prometheus(render(drafts=3.0, draft_tokens=9, accepted=4, p0=3, p1=1, p2=0))
    assert parsed[("vllm:spec_decode_num_drafts_total", (("engine", "0"), ("model_name", "verifier")))] == 3.0


def test_deltas_and_acceptance_math():
    before = spec_decode_counters(render(drafts=10, draft_tokens=30, accepted=12, p0=8, p1=3, p2=1))
    after = spec_decode_counters(render(drafts=110, draft_tokens=330, accepted=162, p0=88, p1=53, p2=21))
    delta = counter_delta(before, after)
    assert delta["num_drafts"] == 100 and delta["per_pos"] == {0: 80, 1: 50, 2: 20}
    acc = acceptance(delta, num_speculative_tokens=3)
    assert acc["mean_acceptance_length"] == pytest.approx(1 + 150 / 100)
    assert acc["acceptance_rate"] == pytest.approx(150 / 300)
    assert acc["per_position_acceptance"] == pytest.approx([0.8, 0.5, 0.2])


def test_no_drafts_is_an_error_not_a_result():
    same = spec_decode_counters(render(drafts=5, draft_tokens=15, accepted=1, p0=1, p1=0, p2=0))
    with pytest.raises(ValueError, match="no speculative drafts"):
        acceptance(counter_delta(same, same), 3)


def test_counters_sum_over_engines():
    text = render(drafts=1, draft_tokens=3, accepted=1, p0=1, p1=0, p2=0) + render(
        drafts=2, draft_tokens=6, accepted=2, p0=2, p1=0, p2=0
    ).replace('engine="0"', 'engine="1"')
    c = spec_decode_counters(text)
    assert c["num_drafts"] == 3 and c["per_pos"][0] == 3
