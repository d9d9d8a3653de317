"""Makes a Python process see an AVX2-only CPU where vLLM and torch look for CPU features.

On PYTHONPATH (devkit.cpu_features.avx2_env puts it there): torch.cpu's probes for AVX-512,
its VNNI and bf16 extensions and AMX answer False as soon as torch.cpu is imported, so vLLM's
kernel loader (`CpuPlatform.import_kernels`) picks its AVX2 build and its kernels take their
AVX2 paths. Imports nothing itself: a process that never imports torch pays nothing.
"""

import importlib.abc
import importlib.machinery
import sys

PROBES = (
    "_is_avx512_supported",
    "_is_avx512_vnni_supported",
    "_is_avx512_bf16_supported",
    "_is_amx_tile_supported",
    "_is_amx_fp16_supported",
)


def _absent() -> bool:
    return False


class TorchCpuProbes(importlib.abc.MetaPathFinder):
    """Finds torch.cpu as the path finder does and answers its feature probes with False once
    it has run."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "torch.cpu":
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            for name in PROBES:
                setattr(module, name, _absent)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, TorchCpuProbes())
