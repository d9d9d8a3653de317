"""The draft's attention in training without flex attention (CPUs): SDPA per packed sample.

A training batch packs several samples into one sequence of T positions, and the test-time
training forward (speculators' Eagle3DraftModel) attends, at chain step s, to s + 1 blocks
of T keys: the first causal within each sample, the others one key per position (its own
chain). Given the dense mask, SDPA computes every query against all (s + 1) T keys and
masks almost all of them away: with samples of n_i tokens only (s + 1) sum n_i^2 of the
(s + 1) T^2 scores are ever used. Flex attention skips the masked blocks on GPUs; on CPUs it
has no backward, so this does the same by hand: one SDPA call per sample, over that
sample's columns of every block, with the same mask rows. The result is SDPA's on the full
mask (the skipped columns are masked for these rows), at a fraction of the cost.

Samples are found from the mask itself (a row that cannot see the row before it starts a
sample), so nothing else has to reach the attention layer: every caller of the draft's
forward (training, validation, the replay) gets it through `train.attn_impl`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

DOC_SDPA = "doc_sdpa"


def sample_bounds(mask: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each packed sample from the first block of a [T, K] boolean mask:
    a row that cannot attend to the row before it starts a new sample. Pure."""
    t = mask.shape[0]
    if t == 0:
        return []
    cannot_see_previous = ~mask[:, :t].diagonal(-1)  # (i + 1, i) for i < T - 1
    starts = [0, *(torch.nonzero(cannot_see_previous).flatten() + 1).tolist()]
    return list(zip(starts, [*starts[1:], t], strict=True))


def doc_sdpa_forward(
    module: torch.nn.Module,  # the attention interface passes the layer
    query: torch.Tensor,  # [1, heads, T, head_dim]
    key: torch.Tensor,  # [1, kv_heads, (s + 1) T, head_dim]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,  # bool [1, 1, T, (s + 1) T]
    scaling: float | None = None,
    dropout: float = 0.0,
    **_kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention output [1, T, heads, head_dim] (transformers' layout), as SDPA's with the full mask."""
    t, k = query.shape[2], key.shape[2]
    gqa = query.shape[1] != key.shape[1]
    full = (
        attention_mask is None
        or attention_mask.dtype != torch.bool
        or query.shape[0] != 1
        or attention_mask.shape[0] != 1
        or k % t
    )
    if full:  # not the packed test-time-training layout: plain SDPA
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=gqa
        )
        return out.transpose(1, 2).contiguous(), None
    mask = attention_mask[0, 0]
    blocks = k // t
    outs = []
    for a, b in sample_bounds(mask):
        cols = [slice(j * t + a, j * t + b) for j in range(blocks)]
        outs.append(
            F.scaled_dot_product_attention(
                query[:, :, a:b],
                torch.cat([key[:, :, c] for c in cols], dim=2),
                torch.cat([value[:, :, c] for c in cols], dim=2),
                attn_mask=torch.cat([mask[a:b, c] for c in cols], dim=1)[None, None],
                dropout_p=dropout,
                scale=scaling,
                enable_gqa=gqa,
            )
        )
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def register() -> None:
    """Make `DOC_SDPA` an attention implementation transformers' layers can be built with. Idempotent."""
    from transformers import AttentionInterface

    AttentionInterface.register(DOC_SDPA, doc_sdpa_forward)
