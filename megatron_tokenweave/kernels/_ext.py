"""Loading of the compiled extension (`megatron_tokenweave._C`) and the ops' fake implementations.

Prefers the installed extension (built by setup.py); on a machine with CUDA it falls back to
JIT-compiling the same sources from `csrc/` with torch.utils.cpp_extension.load (build directory
`$TOKENWEAVE_BUILD_DIR`, default `~/.cache/megatron_tokenweave/jit`).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import torch

from megatron_tokenweave import build_flags

_lock = threading.Lock()
_loaded = False
_load_error: str | None = None


class KernelUnavailableError(RuntimeError):
    """The CUDA extension is neither installed nor buildable here (no GPU, no sources, no nvcc)."""


def _csrc_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "csrc"


def _jit_build(verbose: bool) -> None:
    from torch.utils.cpp_extension import load

    csrc = _csrc_dir()
    sources = sorted(str(p) for p in csrc.glob("*.cu"))
    sources += sorted(str(p) for p in csrc.glob("*.cpp"))
    if not sources:
        raise KernelUnavailableError(
            f"no installed megatron_tokenweave._C and no sources in {csrc}")
    default = Path.home() / ".cache" / "megatron_tokenweave" / "jit"
    build = Path(os.environ.get("TOKENWEAVE_BUILD_DIR", default))
    build.mkdir(parents=True, exist_ok=True)
    load(
        name="megatron_tokenweave_C",
        sources=sources,
        extra_include_paths=[str(csrc / "include")],
        extra_cuda_cflags=build_flags.nvcc_flags(),  # archs: TOKENWEAVE_CUDA_ARCHS, default 90
        extra_cflags=build_flags.cxx_flags(),
        build_directory=str(build),
        is_python_module=False,
        verbose=verbose,
    )


def _register_fakes() -> None:
    """Fake (meta) implementations: the ops mutate their outputs in place and return nothing."""

    @torch.library.register_fake("tokenweave::fused_allreduce_rmsnorm")
    def _fused_fake(comm, partial, residual, weight, eps, residual_out, normed_out, ctas, path,
                    tag, normed_scales, scaling):
        return None

    @torch.library.register_fake("tokenweave::gemm_reduce_rmsnorm")
    def _gemm_reduce_fake(comm, partial, residual, weight, eps, residual_out, normed_out, call,
                          normed_scales, scaling):
        return None

    @torch.library.register_fake("tokenweave::fit_gemm")
    def _fit_gemm_fake(x, weight, bias, regions, geometry, ctas, scales, out_dtype, split):
        return None


def load_extension(verbose: bool = False) -> None:
    """Make `torch.ops.tokenweave.*` available; raise KernelUnavailableError if impossible."""
    global _loaded, _load_error
    if _loaded:  # the hot path never gets here: communicators load the extension once
        return
    with _lock:
        if _loaded:
            return
        if _load_error is not None:
            raise KernelUnavailableError(_load_error)
        try:
            try:
                import megatron_tokenweave._C  # noqa: F401
            except ImportError as exc:
                if not torch.cuda.is_available() or torch.version.cuda is None:
                    raise KernelUnavailableError(
                        f"megatron_tokenweave._C is not installed ({exc}) and there is no CUDA "
                        "device/toolkit to JIT-build it"
                    ) from exc
                _jit_build(verbose)
            _register_fakes()
        except KernelUnavailableError as exc:
            _load_error = str(exc)
            raise
        except Exception as exc:  # build errors: keep the message, do not retry every call
            _load_error = f"building the tokenweave CUDA extension failed: {exc}"
            raise KernelUnavailableError(_load_error) from exc
        _loaded = True


def is_available() -> bool:
    """True if the CUDA kernels can run here (extension loadable and a GPU present)."""
    if not torch.cuda.is_available():
        return False
    try:
        load_extension()
    except KernelUnavailableError:
        return False
    return True


def fitted_gemm_available(device: torch.device) -> bool:
    """True where the fitted communicating GEMM (csrc/include/tokenweave/fit_gemm.cuh) runs: an
    sm_90 GPU and the extension (built for sm_90a, which has the op)."""
    return (device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)
            and is_available() and hasattr(torch.ops.tokenweave, "fit_gemm"))
