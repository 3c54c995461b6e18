"""Pure-PyTorch definition of the fused all-reduce + residual add + RMSNorm.

This is the semantics every kernel is tested against. It runs on any torch.distributed backend
(gloo on CPU, NCCL on GPU) and accumulates in fp32, like the kernel.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_tokenweave.ops.fp8_rows import write_replicated
from megatron_tokenweave.ops.validate import Layout, check_fused_args


def rms_norm_fp32(y: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of fp32 rows, weight applied in fp32 (what the kernel computes in registers)."""
    return y * torch.rsqrt(y.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float()


def fused_allreduce_rmsnorm_reference(
    partial: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    residual_out: torch.Tensor,
    normed_out: torch.Tensor | None,
    layout: Layout,
    group: dist.ProcessGroup,
) -> None:
    """Reference of the fused op; see `Communicator.allreduce_rmsnorm` for the contract."""
    world = dist.get_world_size(group)
    check_fused_args(partial, residual, weight, residual_out, normed_out, layout, world)
    chunks, rows, hidden = partial.shape
    if rows == 0:
        return
    acc = partial.float()
    if layout is Layout.SEQUENCE_PARALLEL:
        # Reduce-scatter by chunk: rank r gets sum_p partial_p[r].
        mine = torch.empty(rows, hidden, dtype=torch.float32, device=partial.device)
        dist.reduce_scatter_tensor(mine, acc.reshape(chunks * rows, hidden), group=group)
    else:
        mine = partial[0].to(torch.float32, copy=True)  # never reduce into the caller's input
        dist.all_reduce(mine, group=group)
    y = mine + residual.float()
    if weight is not None:
        normed = rms_norm_fp32(y, weight, eps).to(partial.dtype)
        if layout is Layout.SEQUENCE_PARALLEL:
            gathered = torch.empty(world, rows, hidden, dtype=partial.dtype, device=partial.device)
            dist.all_gather_into_tensor(gathered.view(world * rows, hidden), normed, group=group)
            normed_out.copy_(gathered)
        else:
            write_replicated(normed_out, normed)
    residual_out.copy_(y.to(residual_out.dtype))
