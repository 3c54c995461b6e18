"""Python wrapper of the fused all-reduce + residual add + RMSNorm CUDA kernel."""

from __future__ import annotations

import os

import torch

from megatron_tokenweave.kernels._ext import load_extension
from megatron_tokenweave.kernels.copy_engine import CopyEngineMirror
from megatron_tokenweave.kernels.policy import MULTIMEM, select_backend
from megatron_tokenweave.kernels.symmetric import SymmetricBuffer
from megatron_tokenweave.ops.validate import (
    KERNEL_DTYPES,
    MAX_CTAS,
    MAX_HIDDEN,
    PHASES,
    Layout,
    Phase,
    TokenWeaveInputError,
    check_fused_args,
    check_phase,
)

MIN_CTAS = 1
DEFAULT_CTAS = 16
# Replicated layout: every rank pulls every row from every peer (no reduce-scatter +
# all-gather). At TP=2 that moves the same total bytes as a two-shot, but all in one link
# direction instead of half in each, and it needs one barrier pair instead of a second data
# phase; a two-shot would pay off above ~1K tokens at TP>=4. Not implemented: the
# sequence-parallel layout is the fast path (a two-shot whose gather writes the normed rows
# straight to the peers).
#
# Small replicated calls take the flagless one-shot path (csrc/include/tokenweave/oneshot.cuh)
# when all ranks' rows fit one receive buffer; mirrors kOneShotRoundBytes in signal.cuh (a CPU
# test keeps the two equal).
ONESHOT_ROUND_BYTES = 8 << 20


def oneshot_applies(layout: Layout, world: int, rows: int, hidden: int, elem_bytes: int) -> bool:
    """Whether the CUDA op takes the one-shot path for this call (unless TOKENWEAVE_NO_ONESHOT=1,
    which must then be set alike on every rank)."""
    return layout is Layout.REPLICATED and world * rows * hidden * elem_bytes <= ONESHOT_ROUND_BYTES
_mc_supported: dict[int, bool] = {}


def _multicast_supported(device: torch.device) -> bool:
    if device.index not in _mc_supported:
        _mc_supported[device.index] = bool(
            torch.ops.tokenweave.device_multicast_supported(device.index))
    return _mc_supported[device.index]


def check_kernel_args(partial: torch.Tensor, residual: torch.Tensor,
                      weight: torch.Tensor | None, residual_out: torch.Tensor,
                      normed_out: torch.Tensor | None, layout: Layout,
                      buffer: SymmetricBuffer, ctas: int) -> None:
    """Contract checks + kernel-specific ones; raise TokenWeaveInputError."""
    check_fused_args(partial, residual, weight, residual_out, normed_out, layout, buffer.world)
    if partial.dtype not in KERNEL_DTYPES:
        raise TokenWeaveInputError(f"the CUDA kernel takes bf16 or fp16, got {partial.dtype}")
    tensors = {"partial": partial, "residual": residual, "residual_out": residual_out}
    if weight is not None:
        tensors.update(weight=weight, normed_out=normed_out)
    for name, t in tensors.items():
        if t.device != buffer.device:
            raise TokenWeaveInputError(
                f"{name} is on {t.device}, the symmetric buffer on {buffer.device}")
        if t.data_ptr() % 16:
            raise TokenWeaveInputError(f"{name} is not 16-byte aligned")
    if not isinstance(ctas, int) or not MIN_CTAS <= ctas <= MAX_CTAS:
        raise TokenWeaveInputError(f"ctas must be an int in [{MIN_CTAS}, {MAX_CTAS}], got {ctas!r}")
    if partial.shape[-1] > MAX_HIDDEN:
        raise TokenWeaveInputError(f"hidden {partial.shape[-1]} > {MAX_HIDDEN}")
    if not buffer.contains(partial):
        raise _partial_outside(partial, buffer, f"the symmetric buffer ({buffer.nbytes} bytes)")
    if weight is not None and layout is Layout.SEQUENCE_PARALLEL:
        if not buffer.contains(normed_out):
            raise TokenWeaveInputError(
                f"normed_out (offset {buffer.offset_of(normed_out)}) is not inside the symmetric "
                f"buffer ({buffer.nbytes} bytes): sequence-parallel rows are stored to every peer")
        if normed_out.shape[0] > 1 and (normed_out.stride(0) * normed_out.element_size()) % 16:
            raise TokenWeaveInputError("normed_out chunk stride must be a multiple of 16 bytes")


def _partial_outside(partial: torch.Tensor, buffer: SymmetricBuffer,
                     region: str) -> TokenWeaveInputError:
    return TokenWeaveInputError(
        f"partial (offset {buffer.offset_of(partial)}, "
        f"{partial.numel() * partial.element_size()} bytes) is not inside {region}")


def _check_phase(phase: Phase, mirror: CopyEngineMirror | None, layout: Layout,
                 weight: torch.Tensor | None) -> None:
    check_phase(phase, layout, weight)
    if phase != "whole" and mirror is None:
        raise TokenWeaveInputError(f"phase {phase!r} needs the copy-engine data path (a mirror)")


def _check_mirror(mirror: CopyEngineMirror, buffer: SymmetricBuffer, partial: torch.Tensor,
                  backend: str) -> None:
    if mirror.buffer is not buffer:
        raise TokenWeaveInputError("the copy-engine mirror belongs to another symmetric buffer")
    if backend not in ("auto", "p2p"):
        raise TokenWeaveInputError(f"the copy-engine data path is peer-to-peer, not {backend!r}")
    if not mirror.covers(partial):
        raise _partial_outside(partial, buffer,
                               f"the {mirror.nbytes} mirrored bytes of the symmetric buffer")


def fused_allreduce_rmsnorm(
    partial: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    residual_out: torch.Tensor,
    normed_out: torch.Tensor | None,
    layout: Layout,
    buffer: SymmetricBuffer,
    *,
    ctas: int = DEFAULT_CTAS,
    backend: str = "auto",
    validate: bool = True,
    mirror: CopyEngineMirror | None = None,
    phase: Phase = "whole",
) -> None:
    """y = sum_p partial_p[chunk] + residual; residual_out = y; normed_out = RMSNorm(y) * weight.

    Same contract as ops.reference.fused_allreduce_rmsnorm_reference (see ops/validate.py), on the
    current CUDA stream, with no host sync and no allocation (CUDA-graph capturable). `partial`
    (and, in the sequence-parallel layout, `normed_out`) must be views of `buffer.local`. Every rank
    must call with the same shapes, layout and ctas, in the same order. backend: "auto" | "p2p" |
    "multimem" (kernels.policy; multimem is opt-in and untested here).
    mirror: take the copy-engine data path (copy_engine.cuh) with these mirrors of `buffer`
    (peer access by copy engines; `ctas` CTAs then only reduce and normalize local rows). Every
    rank must choose the same path.
    phase: on the copy-engine path, "transfer" issues only the pull of the peers' rows (with its
    barriers; the peers are then done with this rank's rows) and "reduce" only the local
    reduction + norm, which must follow the transfer in stream order (an event between streams);
    "whole" both. Every rank issues the same phases in the same order.
    """
    load_extension()
    _check_phase(phase, mirror, layout, weight)  # always: a wrong phase would run the op twice
    if validate:
        check_kernel_args(partial, residual, weight, residual_out, normed_out, layout, buffer,
                          ctas)
        if mirror is not None:
            _check_mirror(mirror, buffer, partial, backend)
    if mirror is not None:
        torch.ops.tokenweave.fused_allreduce_rmsnorm_copy_engine(
            partial, residual, weight, float(eps), residual_out, normed_out,
            layout is Layout.SEQUENCE_PARALLEL, buffer.bases, buffer.signal, buffer.rank,
            buffer.world, buffer.local_base, buffer.nbytes, ctas, int(buffer.timeout_s * 1e9),
            mirror.sources, mirror.mirror, buffer.peer_data, mirror.mirrors, mirror.nbytes,
            PHASES.index(phase))
        return
    chosen = select_backend(backend, os.environ,
                            backend != "p2p" and buffer.multicast_base is not None
                            and _multicast_supported(buffer.device),
                            buffer.multicast_base)
    args = (partial, residual, weight, float(eps), residual_out, normed_out,
            layout is Layout.SEQUENCE_PARALLEL, buffer.bases, buffer.signal, buffer.rank,
            buffer.world, buffer.local_base, buffer.nbytes, ctas, int(buffer.timeout_s * 1e9))
    if chosen == MULTIMEM:
        torch.ops.tokenweave.fused_allreduce_rmsnorm_multimem(*args, int(buffer.multicast_base))
    else:
        torch.ops.tokenweave.fused_allreduce_rmsnorm(*args)
