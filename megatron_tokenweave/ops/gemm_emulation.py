"""The GEMM-fused mechanism on backends without the CUDA kernels (CPU over gloo, GPUs without
peer access): the same data movement with torch.distributed collectives, so the layer's control
flow, the segment geometry (ops/segments.py) and the inbox rows of both sets run everywhere.

- `store_to_owners` is the communicating GEMM: each rank computes its partial rows of every
  segment (fp32 accumulation, bias added before rounding, like the Triton epilogue) and segment
  c lands in rank c's inbox, slot = the sender's rank (one all_to_all_single stands for the
  peer stores; the flags have nothing to order here);
- `reduce_owned` is the consumer: the owner sums its rows of every slot in fp32, in rank order,
  adds the residual; sequence parallel, normalizes and gathers the normed rows; replicated,
  gathers y rounded once and every rank normalizes all rows (as the kernel does).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_tokenweave.ops.fp8_operands import Fp8Operands
from megatron_tokenweave.ops.fp8_rows import Fp8Rows, write_replicated
from megatron_tokenweave.ops.reference import rms_norm_fp32
from megatron_tokenweave.ops.segments import Segments
from megatron_tokenweave.ops.validate import Layout


def store_to_owners(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    seg: Segments, inbox: torch.Tensor, group: dist.ProcessGroup,
                    fp8: Fp8Operands | None = None) -> None:
    """x: [rows, K] (every chunk's rows); weight: [hidden, K]; inbox: this rank's
    [world, slot_rows, hidden] slots; fp8: x and weight are e4m3 with these scales (their
    dequantized product, rounded once to the inbox's dtype)."""
    world = dist.get_world_size(group)
    xs, wf = fp8.dequantized(x, weight) if fp8 is not None else (x, weight.float())
    send = inbox.new_zeros(world, seg.rows, weight.shape[0])
    for c in range(world):
        n = seg.length(c)
        if n:
            start = seg.first + c * seg.step
            out = xs[start:start + n].float() @ wf.t()
            if bias is not None:
                out += bias.float()
            send[c, :n] = out.to(inbox.dtype)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    inbox[:, seg.row0:seg.row0 + seg.rows].copy_(recv)


def reduce_owned(inbox: torch.Tensor, seg: Segments, partial: torch.Tensor,
                 residual: torch.Tensor, weight: torch.Tensor | None, eps: float,
                 residual_out: torch.Tensor, normed_out: torch.Tensor | Fp8Rows | None,
                 layout: Layout, group: dist.ProcessGroup) -> None:
    """The owner's reduction of this call's rows; the fused op's contract for the outputs
    (FP8 normed rows included; `partial` gives the call's [chunks, rows, hidden] shape and
    dtype)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    _, rows, hidden = partial.shape
    n = seg.length(rank)
    y = torch.zeros(n, hidden, dtype=torch.float32, device=inbox.device)
    for q in range(world):  # rank order, like the kernel
        y += inbox[q, seg.row0:seg.row0 + n].float()
    if layout is Layout.SEQUENCE_PARALLEL:
        y += residual.float()
        residual_out.copy_(y.to(residual_out.dtype))
        if weight is not None:
            normed = rms_norm_fp32(y, weight, eps).to(partial.dtype)
            gathered = torch.empty(world, rows, hidden, dtype=partial.dtype, device=y.device)
            dist.all_gather_into_tensor(gathered.view(world * rows, hidden), normed, group=group)
            normed_out.copy_(gathered)
        return
    first = rank * seg.rows
    mine = torch.zeros(seg.rows, hidden, dtype=partial.dtype, device=y.device)
    mine[:n] = (y + residual[first:first + n].float()).to(partial.dtype)
    every = torch.empty(world * seg.rows, hidden, dtype=partial.dtype, device=y.device)
    dist.all_gather_into_tensor(every, mine, group=group)
    y_all = every[:rows]
    residual_out.copy_(y_all)
    if weight is not None:
        write_replicated(normed_out, rms_norm_fp32(y_all.float(), weight, eps).to(partial.dtype))
