"""CUDA kernels of megatron_tokenweave: the fused all-reduce + residual add + RMSNorm op over a
CUDA-IPC symmetric buffer, launched through a C++ communicator held by handle. Importing this
package needs no GPU; using it does."""

from megatron_tokenweave.kernels._ext import KernelUnavailableError, is_available, load_extension
from megatron_tokenweave.kernels.comm import (
    DEFAULT_CTAS,
    MAX_CTAS,
    MIN_CTAS,
    ONESHOT_ROUND_BYTES,
    PATHS,
    KernelComm,
    KernelSettings,
    check_kernel_args,
    oneshot_applies,
)
from megatron_tokenweave.kernels.copy_engine import CopyEngineMirror
from megatron_tokenweave.kernels.policy import multimem_refusal, select_backend
from megatron_tokenweave.kernels.symmetric import SymmetricBuffer

__all__ = [
    "CopyEngineMirror",
    "DEFAULT_CTAS",
    "MAX_CTAS",
    "MIN_CTAS",
    "ONESHOT_ROUND_BYTES",
    "PATHS",
    "KernelComm",
    "KernelSettings",
    "KernelUnavailableError",
    "SymmetricBuffer",
    "check_kernel_args",
    "is_available",
    "load_extension",
    "multimem_refusal",
    "oneshot_applies",
    "select_backend",
]
