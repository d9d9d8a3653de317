"""hidden_states: the verifier's aux-layer and final-layer states for every training token.

Layer convention (vLLM and speculators): an aux layer id `i` is the *input* of decoder
layer i (the residual stream after layers 0..i-1), by default i in (2, L//2, L-3); the
final state is the last layer's output *before* the final norm, which vLLM names layer id
L. The trainer recomputes the verifier's logits as lm_head(norm(final)).

Two backends write the same shard, chosen by `hidden_states.backend`:

- `hf`: a transformers forward (CPU, one GPU, or several with `device: auto`), batched by
  token budget. Hooks record exactly the tensors above during the base model's forward,
  so no per-layer tuple is kept and no logits are computed.
- `vllm`: vLLM's `extract_hidden_states` speculative method with its hidden-states KV
  connector, for verifiers only vLLM can serve (INT4 MoE, tensor parallel 8).

Each shard is one Snakemake job and one safetensors file, written atomically (a killed job
leaves no shard). Tokens are stored unpadded: bytes per token = (len(aux) + 1) x hidden x
dtype size.
"""
