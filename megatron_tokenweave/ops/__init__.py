"""The fused all-reduce + residual add + RMSNorm op: contract, reference, dispatch."""

from megatron_tokenweave.ops.fused import fused_allreduce_rmsnorm
from megatron_tokenweave.ops.reference import fused_allreduce_rmsnorm_reference
from megatron_tokenweave.ops.validate import Layout, TokenWeaveInputError

__all__ = [
    "Layout",
    "TokenWeaveInputError",
    "fused_allreduce_rmsnorm",
    "fused_allreduce_rmsnorm_reference",
]
