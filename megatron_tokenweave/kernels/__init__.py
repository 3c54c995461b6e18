"""CUDA kernels of megatron_tokenweave: the fused all-reduce + residual add + RMSNorm op over a
CUDA-IPC symmetric buffer (or, opt-in and untested here, a torch symmetric-memory buffer with a
multicast address: MulticastBuffer), launched through a C++ communicator held by handle.
Importing this package needs no GPU; using it does."""

from megatron_tokenweave.kernels._ext import KernelUnavailableError, is_available, load_extension
from megatron_tokenweave.kernels.comm import (
    DEFAULT_CTAS,
    MAX_CTAS,
    MIN_CTAS,
    ONESHOT_ROUND_BYTES,
    PATHS,
    TWOSHOT_MIN_WORLD,
    KernelComm,
    KernelSettings,
    call_tag,
    check_kernel_args,
    oneshot_applies,
    twoshot_applies,
)
from megatron_tokenweave.kernels.copy_engine import CopyEngineMirror
from megatron_tokenweave.kernels.multicast import MulticastBuffer, agreed_refusal
from megatron_tokenweave.kernels.policy import (
    MulticastFacts,
    Refusal,
    multimem_backend_refusal,
    multimem_refusal,
    select_backend,
)
from megatron_tokenweave.kernels.symmetric import ERROR_WORDS, PeerBuffer, SymmetricBuffer

__all__ = [
    "CopyEngineMirror",
    "DEFAULT_CTAS",
    "ERROR_WORDS",
    "MAX_CTAS",
    "MIN_CTAS",
    "MulticastBuffer",
    "MulticastFacts",
    "ONESHOT_ROUND_BYTES",
    "PATHS",
    "PeerBuffer",
    "Refusal",
    "TWOSHOT_MIN_WORLD",
    "KernelComm",
    "KernelSettings",
    "KernelUnavailableError",
    "SymmetricBuffer",
    "agreed_refusal",
    "call_tag",
    "check_kernel_args",
    "is_available",
    "load_extension",
    "multimem_backend_refusal",
    "multimem_refusal",
    "oneshot_applies",
    "select_backend",
    "twoshot_applies",
]
