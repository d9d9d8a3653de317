"""The compact target (`hidden_states.target: topk`): what the loss needs from the final state.

Training uses the verifier's final pre-norm state only to rebuild the verifier's logits on the
draft vocabulary, lm_head(norm(state)), and the loss only through their softmax. So a shard may
keep, instead of the state (hidden_size values per token: 14 KB for Kimi-K2.5 in bf16), the
verifier's k largest logits: k (id, logit) pairs, 6 bytes each (384 B per token at k = 64).

The ids are of the verifier's whole vocabulary, so shards stay independent of the draft
vocabulary (a vocab variant trains on the same shards); training keeps the pairs whose id is
in its draft vocabulary. The logits are stored less the token's largest (all <= 0, float16:
the softmax is unchanged, and values near the top, which carry the mass, keep 11 bits).

What is lost: the mass outside the top k, which training's softmax renormalises away, and
positions none of whose k ids are in the draft vocabulary, which leave the loss (with the full
state they would teach the draft the verifier's best guess among tokens it rarely ranks).
BENCHMARKS.md has the bytes and the acceptance in vLLM against shards with the final state.
"""

from __future__ import annotations

import torch

from eagleflow.common.verifier_config import read_text_config
from eagleflow.common.verifier_weights import load_verifier_final_norm, load_verifier_lm_head

CHUNK_TOKENS = 1024  # tokens per lm_head matmul: [chunk, vocab] float32 logits at a time
FILL = -1.0e4  # a draft-vocabulary logit outside the stored top k: exp() of it is 0 in float32


def head_device(device: str) -> str:
    """Where the top-k head runs for `hidden_states.device`: a GPU when one is configured and
    there, else the CPU (2 x vocab x hidden FLOPs per token). Pure but for the CUDA check."""
    if device == "cpu" or not torch.cuda.is_available():
        return "cpu"
    return "cuda:0" if device in ("auto", "cuda") else device


class TopkHead:
    """The verifier's final norm and lm_head, loaded once; maps final states to top-k logits."""

    def __init__(self, verifier_dir: str, k: int, device: str = "cpu"):
        if k < 1:
            raise ValueError(f"hidden_states.topk must be at least 1, got {k}")
        lm_head = load_verifier_lm_head(verifier_dir)
        self.k = min(k, lm_head.shape[0])
        self.device = torch.device(device)
        self.lm_head = lm_head.to(self.device, torch.float32)
        self.norm = load_verifier_final_norm(verifier_dir).to(self.device, torch.float32)
        self.eps = float(read_text_config(verifier_dir).get("rms_norm_eps", 1e-6))

    def logits(self, final: torch.Tensor) -> torch.Tensor:
        """The verifier's float32 logits [n, vocab] of final states [n, hidden]: lm_head(norm(state))."""
        x = final.to(self.device, torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm
        return x @ self.lm_head.T

    @torch.inference_mode()
    def __call__(self, final: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids int32 [n, k], logits less each row's largest, float16 [n, k]) of final states [n, hidden]."""
        ids, values = [], []
        for chunk in final.split(CHUNK_TOKENS):
            top = self.logits(chunk).topk(self.k, dim=-1)  # sorted: column 0 is the largest
            ids.append(top.indices.to(torch.int32).cpu())
            values.append((top.values - top.values[:, :1]).to(torch.float16).cpu())
        if not ids:
            return torch.zeros(0, self.k, dtype=torch.int32), torch.zeros(0, self.k, dtype=torch.float16)
        return torch.cat(ids), torch.cat(values)


def draft_index(t2d: torch.Tensor) -> torch.Tensor:
    """For each verifier-vocabulary id, its index in the draft vocabulary, or -1. Pure."""
    keep = t2d.to(torch.bool)
    index = torch.full(keep.shape, -1, dtype=torch.long)
    index[keep] = torch.arange(int(keep.sum()))
    return index


def dense_targets(ids: torch.Tensor, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Logits [..., vocab_size] on the draft vocabulary from top-k pairs [..., k] whose ids are
    draft indices (-1: not in the draft vocabulary, dropped); FILL elsewhere. Pure."""
    out = torch.full((*ids.shape[:-1], vocab_size + 1), FILL, dtype=torch.float32, device=ids.device)
    # Ids of -1 land in the extra last column, cut off below.
    out.scatter_(-1, torch.where(ids < 0, vocab_size, ids), logits.float())
    return out[..., :vocab_size]
