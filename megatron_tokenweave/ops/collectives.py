"""The fused op's contract carried out by torch.distributed collectives in the activations' dtype,
then a separate residual add and RMSNorm: the stock Megatron mechanism (NCCL all-reduce or
reduce-scatter / all-gather), inside TokenWeave's schedule.

The split policy chooses it per token count where NCCL moves the bytes faster than the P2P kernel
(large prefills); beside the other half's GEMMs it runs on the side stream like the kernel. Its
numerics are the stock layer's: the reduced sum is rounded to the activations' dtype before the
residual add. The reduction runs in place in `partial` (workspace scratch), so `partial` is
clobbered, unlike the fp32 reference.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_tokenweave.ops.fp8_rows import write_replicated
from megatron_tokenweave.ops.validate import Layout


def allreduce_add_rmsnorm_collectives(
    partial: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    residual_out: torch.Tensor,
    normed_out: torch.Tensor | None,
    layout: Layout,
    group: dist.ProcessGroup,
) -> None:
    """See `Communicator.allreduce_rmsnorm` for the contract (arguments already checked)."""
    chunks, rows, hidden = partial.shape
    if rows == 0:
        return
    if layout is Layout.SEQUENCE_PARALLEL:
        mine = partial[dist.get_rank(group)]  # in place: NCCL's reduce-scatter into its own chunk
        dist.reduce_scatter_tensor(mine, partial.view(chunks * rows, hidden), group=group)
    else:
        mine = partial[0]
        dist.all_reduce(mine, group=group)
    torch.add(mine, residual, out=residual_out)
    if weight is None:
        return
    normed = F.rms_norm(residual_out, (hidden,), weight, eps)
    if layout is Layout.SEQUENCE_PARALLEL:
        gathered = torch.empty(chunks * rows, hidden, dtype=normed.dtype, device=normed.device)
        dist.all_gather_into_tensor(gathered, normed, group=group)
        normed_out.copy_(gathered.view(chunks, rows, hidden))
    else:
        write_replicated(normed_out, normed)
