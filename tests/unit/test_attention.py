"""doc_sdpa (train.attention): the draft's attention per packed sample gives SDPA's result on
the full mask, for the loss and every gradient, on the test-time-training layout."""

import pytest
import torch
from speculators.losses import resolve_loss_config

from eagleflow.train.attention import doc_sdpa_forward, sample_bounds
from eagleflow.train.data import collate
from tests.helpers import random_samples, tiny_draft


def test_sample_bounds_come_from_the_mask():
    docs = torch.tensor([0, 0, 0, 1, 2, 2])
    causal = torch.arange(6)[:, None] >= torch.arange(6)[None, :]
    mask = causal & (docs[:, None] == docs[None, :])
    assert sample_bounds(mask) == [(0, 3), (3, 4), (4, 6)]
    assert sample_bounds(torch.ones(1, 1, dtype=torch.bool)) == [(0, 1)]


def test_other_layouts_fall_back_to_plain_sdpa():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 5, 8, generator=g) for _ in range(3))
    out, _ = doc_sdpa_forward(None, q, k, v, None)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2)
    assert torch.allclose(out, want, atol=1e-6)


@pytest.mark.parametrize("sliding_window", [None, 4])
def test_doc_sdpa_equals_sdpa_on_packed_test_time_training(tiny_llama_dir, sliding_window):
    samples = random_samples([7, 1, 12, 5], seed=1)
    batch = collate(samples, 64)
    results = {}
    for impl in ("sdpa", "doc_sdpa"):
        model = tiny_draft(tiny_llama_dir, impl, sliding_window=sliding_window)
        _, loss, metrics = model(**batch, ttt_steps=3, loss_config=resolve_loss_config("kl_div", "eager"))
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[impl] = (loss.detach(), metrics, grads)
    (loss_a, metrics_a, grads_a), (loss_b, metrics_b, grads_b) = results["sdpa"], results["doc_sdpa"]
    assert torch.allclose(loss_a, loss_b, rtol=1e-5)
    # Other shapes give the CPU's matrix kernels other summation orders: the loss sums agree to
    # float32 rounding (measured 6.5e-7 relative on an AVX-512 CPU), counts exactly.
    assert {k: float(v) for k, v in metrics_a.items()} == pytest.approx(
        {k: float(v) for k, v in metrics_b.items()}, rel=1e-5
    )
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name, grad in grads_a.items():
        assert torch.allclose(grad, grads_b[name], rtol=1e-4, atol=1e-6), name


def test_flex_attention_takes_a_packed_batch_padded_to_its_block_size(tiny_llama_dir):
    """speculators extends flex attention's block mask for each TTT step by whole 128-token
    blocks, so a batch whose length is no multiple of 128 is refused at the second step (the
    GPU check's Kimi draft: 15,575 tokens against a 15,616-token mask). Padded to
    Runtime.step_length, flex attention gives the unpadded SDPA loss and metrics."""
    from eagleflow.train.device import FLEX_BLOCK_SIZE, Runtime
    from eagleflow.train.steps import pad_to_length

    samples = random_samples([90, 1, 60], seed=2)
    batch = collate(samples, 256)
    assert batch["input_ids"].shape[1] % FLEX_BLOCK_SIZE  # 151 tokens: not a whole block
    # One length for every step (one compile on CUDA), in whole blocks; none on a CPU's SDPA.
    flex = Runtime(0, 1, torch.device("cpu"), "simple_flex_attention", "eager")
    assert flex.step_length(256) == 256 and flex.step_length(200) == 2 * FLEX_BLOCK_SIZE
    assert Runtime(0, 1, torch.device("cuda"), "sdpa", "eager").step_length(300) == 3 * FLEX_BLOCK_SIZE
    assert Runtime(0, 1, torch.device("cpu"), "doc_sdpa", "eager").step_length(256) == 0
    padded = pad_to_length(batch, flex.step_length(256))
    assert padded["input_ids"].shape[1] == 256 and pad_to_length(batch, 0) is batch
    assert not padded["loss_mask"][0, 151:].any() and (padded["document_ids"][0, 151:] == -1).all()
    fwd = {"ttt_steps": 3, "loss_config": resolve_loss_config("kl_div", "eager")}
    results = {}
    for impl, inputs in (("sdpa", batch), ("simple_flex_attention", padded)):
        model = tiny_draft(tiny_llama_dir, impl)
        with torch.no_grad():
            results[impl] = model(**inputs, **fwd)[1:]
            if impl == "simple_flex_attention":
                with pytest.raises(ValueError, match="block_mask was created for"):
                    model(**batch, **fwd)
    (loss_a, metrics_a), (loss_b, metrics_b) = results["sdpa"], results["simple_flex_attention"]
    assert torch.allclose(loss_a, loss_b, rtol=1e-4)
    assert {k: float(v) for k, v in metrics_a.items()} == pytest.approx(
        {k: float(v) for k, v in metrics_b.items()}, rel=1e-4
    )
