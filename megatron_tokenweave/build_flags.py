"""The compiler flags of the CUDA extension `megatron_tokenweave._C`, in one place.

Used by setup.py (which loads this file by path, so it works before the package or torch can be
imported), by megatron_tokenweave.kernels._ext (the JIT build) and by .ci/compile_csrc.sh (which
runs this file: `python megatron_tokenweave/build_flags.py nvcc --archs "80;90"`). Standard library
only; nothing here imports torch.

TOKENWEAVE_CUDA_ARCHS picks the GPU targets: compute capabilities without the dot, separated by
";" or "," (default "90", Hopper, built as sm_90a; "80;90" adds A100). Below sm_90 the device code
of the bulk-copy and multimem paths and of the fitted GEMM is a trap
(csrc/include/tokenweave/bulk_copy.cuh, fit_gemm.cuh); ops.cu never launches them there.
torch adds its own flags on top of these (COMMON_NVCC_FLAGS, -DTORCH_EXTENSION_NAME, the C++ ABI).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence

ARCHS_ENV = "TOKENWEAVE_CUDA_ARCHS"
DEFAULT_ARCHS = "90"
# The archs CI compiles every source for (.ci/compile_csrc.sh).
CHECK_ARCHS = "80;90"
# The oldest target offered (A100); older archs were never built or run.
MIN_ARCH = 80

CXX_FLAGS: tuple[str, ...] = ("-O3", "-std=c++17")
NVCC_BASE_FLAGS: tuple[str, ...] = ("-O3", "-std=c++17", "--use_fast_math")


class ArchListError(ValueError):
    """TOKENWEAVE_CUDA_ARCHS (or an explicit arch list) is not a usable list of GPU targets."""


def parse_archs(spec: str | None = None) -> list[int]:
    """The target archs, sorted and distinct (90 = sm_90); spec None: TOKENWEAVE_CUDA_ARCHS.

    An unset or blank variable means DEFAULT_ARCHS. Raises ArchListError on anything else that is
    not a list of compute capabilities >= MIN_ARCH written without the dot ("90", "80;90").
    """
    if spec is None:
        spec = os.environ.get(ARCHS_ENV, "")
        source = f"{ARCHS_ENV}={spec!r}"
        if not spec.strip():
            spec = DEFAULT_ARCHS
    else:
        source = f"arch list {spec!r}"
    entries = [e.strip() for e in re.split(r"[;,\s]+", spec) if e.strip()]
    if not entries:
        raise ArchListError(f"{source}: no archs given; expected e.g. \"90\" or \"80;90\"")
    archs = set()
    for entry in entries:
        if not entry.isdigit():
            m = re.fullmatch(r"(?:sm_|compute_)?(\d+)\.?(\d?)", entry)
            hint = f' (write "{m.group(1)}{m.group(2)}")' if m else ""
            raise ArchListError(
                f"{source}: {entry!r} is not a compute capability; expected numbers without the "
                f"dot, separated by ';' or ',', e.g. \"90\" or \"80;90\"{hint}")
        arch = int(entry)
        if arch < MIN_ARCH:
            raise ArchListError(
                f"{source}: sm_{arch} is not supported: TokenWeave's kernels are built for "
                f"sm_{MIN_ARCH} (A100) or newer; the bulk-copy and multimem paths need sm_90 "
                "(Hopper)")
        archs.add(arch)
    return sorted(archs)


def target(arch: int) -> str:
    """The nvcc target of an arch: Hopper's architecture-specific sm_90a (wgmma and setmaxnreg,
    which the fitted GEMM needs; its SASS runs on sm_90 GPUs only, as sm_90's does), the plain
    target elsewhere."""
    return "90a" if arch == 90 else str(arch)


def gencode_flags(archs: Sequence[int]) -> list[str]:
    """One -gencode per arch: SASS for exactly that arch (no PTX for later ones)."""
    return [f"-gencode=arch=compute_{target(a)},code=sm_{target(a)}" for a in archs]


def nvcc_flags(archs: Sequence[int] | str | None = None) -> list[str]:
    """All of our nvcc flags, the -gencode ones included; archs as parse_archs takes or returns."""
    if archs is None or isinstance(archs, str):
        archs = parse_archs(archs)
    return [*NVCC_BASE_FLAGS, *parallel_flags(archs), *gencode_flags(archs)]


def parallel_flags(archs: Sequence[int]) -> list[str]:
    """With several archs, nvcc compiles them in parallel (one thread per core): a kernel
    family's instantiations take minutes per arch on a small machine."""
    return ["--threads=0"] if len(archs) > 1 else []


def cxx_flags() -> list[str]:
    """Our flags for the host compiler (the extension's .cpp sources)."""
    return list(CXX_FLAGS)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python megatron_tokenweave/build_flags.py",
        description="Print the CUDA extension's build flags, one per line.")
    parser.add_argument("what", choices=("nvcc", "cxx", "archs"),
                        help="nvcc: nvcc flags with -gencode; cxx: C++ flags; archs: the arch list")
    parser.add_argument("--archs", default=None,
                        help=f"arch list, as {ARCHS_ENV} (default: ${ARCHS_ENV}, else "
                             f"\"{DEFAULT_ARCHS}\"); 'check' = the archs CI checks "
                             f"(\"{CHECK_ARCHS}\")")
    args = parser.parse_args(argv)
    spec = CHECK_ARCHS if args.archs == "check" else args.archs
    try:
        if args.what == "nvcc":
            out = nvcc_flags(spec)
        elif args.what == "cxx":
            out = cxx_flags()
        else:
            out = [str(a) for a in parse_archs(spec)]
    except ArchListError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
