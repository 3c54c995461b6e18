"""The fused all-reduce + residual add + RMSNorm op's contract and its reference definitions
(megatron_tokenweave.communicator runs it)."""

from megatron_tokenweave.ops.reference import fused_allreduce_rmsnorm_reference
from megatron_tokenweave.ops.validate import Layout, TokenWeaveInputError

__all__ = [
    "Layout",
    "TokenWeaveInputError",
    "fused_allreduce_rmsnorm_reference",
]
