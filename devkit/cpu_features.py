"""Processes that see an AVX2-only CPU on a machine with AVX-512 or AMX: what a CPU without
bf16 units does to eagleflow's stages, checked in CI and timed on any box.

Every place the stages' libraries choose a kernel by CPU feature is capped at AVX2: vLLM's
loader and kernels (through torch.cpu's probes, devkit/avx2_site), torch's own vectorised
kernels (ATEN_CPU_CAPABILITY), oneDNN (its matmuls, bf16 ones included) and MKL. The
environment passes to every child process, so a Snakemake run under it runs its jobs and their
vLLM servers so too.

    python -m devkit.cpu_features avx2 -- snakemake --cores all
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

AVX2_SITE = Path(__file__).resolve().with_name("avx2_site")
AVX2_CAPS = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def avx2_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """`base` (the current environment by default) as an AVX2-only CPU's processes see it."""
    env = dict(os.environ if base is None else base)
    env.update(AVX2_CAPS)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(AVX2_SITE), env.get("PYTHONPATH", "")) if p)
    return env


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("features", choices=["avx2"], help="the CPU the command's processes see")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command to run (give it after --)")
    os.execvpe(command[0], command, avx2_env())


if __name__ == "__main__":
    sys.exit(main())
