"""Argument checks shared by every backend of the fused op: one contract, one set of errors."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from megatron_tokenweave.ops.fp8_rows import Fp8Rows

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
KERNEL_DTYPES = (torch.bfloat16, torch.float16)
VECTOR_BYTES = 16  # the kernels' vector: rows, pitches and starts come in whole ones
VECTOR_ELEMS = VECTOR_BYTES // 2  # a vector of 2-byte elements
# The CUDA kernel's limits (csrc/include/tokenweave/common.cuh: kMaxCtas, kMaxRanks, and
# kMaxThreads * kMaxVecsPerThread * kVecElems; a CPU test keeps them equal). Beyond the last two
# the workspace falls back to the reference op.
MAX_CTAS = 128
MAX_RANKS = 8
MAX_HIDDEN = 32768
Comm = Literal["fused", "collectives", "copy_engine", "gemm"]
COMMS: tuple[str, ...] = ("fused", "collectives", "copy_engine", "gemm")
# What one call of the fused op issues: all of it, or (copy-engine data path, split layers) the
# transfer of the peers' rows alone, or the local reduction + norm alone after it.
Phase = Literal["whole", "transfer", "reduce"]
PHASES: tuple[str, ...] = ("whole", "transfer", "reduce")


class Layout(str, enum.Enum):
    """Where the reduced rows live after the op (DESIGN.md)."""

    SEQUENCE_PARALLEL = "sequence_parallel"  # rank r keeps rows of chunk r; normed rows go to all
    REPLICATED = "replicated"  # every rank keeps every row


def phases_apply(layout: Layout, weight: torch.Tensor | None) -> bool:
    """Whether the copy-engine op can run as a transfer and a separate reduction: only when it
    gathers no normed rows after the reduction (replicated layout, or no norm)."""
    return layout is Layout.REPLICATED or weight is None


def check_phase(phase: str, layout: Layout, weight: torch.Tensor | None) -> None:
    """Raise TokenWeaveInputError for a phase the op cannot take (checked on every call: a wrong
    phase would run an op twice or skip its gather, not fail)."""
    if phase not in PHASES:
        raise TokenWeaveInputError(f"phase must be one of {PHASES}, got {phase!r}")
    if phase != "whole" and not phases_apply(layout, weight):
        raise TokenWeaveInputError(
            "the op runs in phases only when it gathers no normed rows (replicated layout, or "
            "no norm); sequence parallel with a norm takes phase='whole'")


class TokenWeaveInputError(ValueError):
    """Raised for arguments the fused op cannot take; the message says which and why."""


def _rows_contiguous(t: torch.Tensor) -> bool:
    """Last two dims dense (rows of `hidden` elements back to back); the chunk stride is free."""
    return t.stride(-1) == 1 and (t.shape[-2] <= 1 or t.stride(-2) == t.shape[-1])


def check_gemm_operands(x: torch.Tensor, weight: torch.Tensor, what: str) -> None:
    """Raise TokenWeaveInputError unless x [rows, K] and weight [N, K] are 2-D with contiguous
    rows that start a multiple of VECTOR_BYTES apart (a TMA stride) and at least K apart: the
    communicating GEMM's operands, contiguous or with padded rows (ops/gemm_rows.py)."""
    for name, t in (("x", x), ("weight", weight)):
        if t.dim() != 2 or t.stride(1) != 1 or t.stride(0) < t.shape[1] or (
                t.stride(0) * t.element_size() % VECTOR_BYTES):
            raise TokenWeaveInputError(
                f"{what} takes a 2-D {name} whose rows are contiguous, at least K apart and "
                f"a multiple of 16 bytes apart; got shape {tuple(t.shape)}, strides "
                f"{tuple(t.stride())}")


def check_fused_args(
    partial: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    residual_out: torch.Tensor,
    normed_out: torch.Tensor | Fp8Rows | None,
    layout: Layout,
    world: int,
) -> None:
    """Validate the fused op's arguments; raise TokenWeaveInputError with a clear message.
    normed_out: rows in the activations' dtype, or FP8 rows (ops.fp8_rows)."""
    if not isinstance(layout, Layout):
        raise TokenWeaveInputError(f"layout must be a Layout, got {layout!r}")
    if partial.dim() != 3:
        raise TokenWeaveInputError(
            f"partial must be [chunks, rows, hidden], got shape {tuple(partial.shape)}"
        )
    chunks, rows, hidden = partial.shape
    want_chunks = world if layout is Layout.SEQUENCE_PARALLEL else 1
    if chunks != want_chunks:
        raise TokenWeaveInputError(
            f"{layout.value} layout needs partial.shape[0] == {want_chunks} "
            f"(TP group of {world}), got {chunks}"
        )
    if partial.dtype not in SUPPORTED_DTYPES:
        raise TokenWeaveInputError(f"unsupported dtype {partial.dtype}; use bf16, fp16 or fp32")
    if hidden % VECTOR_ELEMS != 0:
        raise TokenWeaveInputError(
            f"hidden size {hidden} is not a multiple of {VECTOR_ELEMS} (16-byte vectors)"
        )
    if not partial.is_contiguous():
        raise TokenWeaveInputError("partial must be contiguous")
    for name, t, shape in (
        ("residual", residual, (rows, hidden)),
        ("residual_out", residual_out, (rows, hidden)),
    ):
        if tuple(t.shape) != shape:
            raise TokenWeaveInputError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
        if t.dtype != partial.dtype:
            raise TokenWeaveInputError(f"{name} dtype {t.dtype} != partial dtype {partial.dtype}")
        if not t.is_contiguous():
            raise TokenWeaveInputError(f"{name} must be contiguous")
        if t.device != partial.device:
            raise TokenWeaveInputError(f"{name} is on {t.device}, partial on {partial.device}")
    if weight is None:
        if normed_out is not None:
            raise TokenWeaveInputError("normed_out given without a norm weight")
        return
    if tuple(weight.shape) != (hidden,):
        raise TokenWeaveInputError(f"weight must have shape ({hidden},), got {tuple(weight.shape)}")
    if weight.dtype != partial.dtype or weight.device != partial.device:
        raise TokenWeaveInputError(
            f"weight must be {partial.dtype} on {partial.device}, "
            f"got {weight.dtype} on {weight.device}"
        )
    if normed_out is None:
        raise TokenWeaveInputError("normed_out is required when a norm weight is given")
    from megatron_tokenweave.ops.fp8_rows import Fp8Rows  # it imports this module

    if isinstance(normed_out, Fp8Rows):
        if layout is not Layout.REPLICATED:
            raise TokenWeaveInputError("FP8 normed rows take the replicated layout")
        normed_out.check(rows, hidden, partial.device)
        return
    if tuple(normed_out.shape) != (chunks, rows, hidden):
        raise TokenWeaveInputError(
            f"normed_out must have shape {(chunks, rows, hidden)}, got {tuple(normed_out.shape)}"
        )
    if normed_out.dtype != partial.dtype or normed_out.device != partial.device:
        raise TokenWeaveInputError("normed_out must match partial's dtype and device")
    if not _rows_contiguous(normed_out):
        raise TokenWeaveInputError(
            "normed_out rows must be dense (stride(-1)=1, stride(-2)=hidden)"
        )
