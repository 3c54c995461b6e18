"""The kernel level of the fused op: a C++ communicator over one symmetric buffer, held by handle.

KernelComm creates the C++ object (csrc/ops.cu: comm_create) with the buffer's addresses and the
protocol settings, and launches the ops through it: `torch.ops.tokenweave.
fused_allreduce_rmsnorm(handle, tensors, eps, ctas, path, tag, normed_scales, scaling)`
(the last two describe FP8 normed rows, ops.fp8_rows) and the GEMM-fused consumer
`gemm_reduce_rmsnorm(handle, tensors, eps, call, normed_scales, scaling)` (`call`: the segments'
geometry, the CTA count and the tag as one list). `tag` names the call
(`call_tag`: the caller's call number hashed with the call's shape), and a peer whose kernel
publishes another call's tag or epoch is an error (csrc/include/tokenweave/signal.cuh), never two
calls' rows combined. Settings that change the protocol (bulk pipeline, one-shot path, timeout,
multicast) are fixed when it is created and must be the same on every rank;
megatron_tokenweave.communicator agrees them collectively. Nothing here reads the environment,
and a call takes no lock.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_tokenweave.kernels._ext import load_extension
from megatron_tokenweave.kernels.copy_engine import CopyEngineMirror
from megatron_tokenweave.kernels.symmetric import PeerBuffer
from megatron_tokenweave.ops.fp8_rows import Fp8Rows
from megatron_tokenweave.ops.segments import Segments
from megatron_tokenweave.ops.validate import (
    KERNEL_DTYPES,
    MAX_CTAS,
    MAX_HIDDEN,
    VECTOR_BYTES,
    Layout,
    Phase,
    TokenWeaveInputError,
    check_fused_args,
    check_phase,
)

MIN_CTAS = 1
DEFAULT_CTAS = 16
# Replicated layout, by size and TP (csrc/ops.cu launch_sm):
# - small calls take the flagless one-shot path (csrc/include/tokenweave/oneshot.cuh) when all
#   ranks' rows fit one receive buffer (ONESHOT_ROUND_BYTES mirrors kOneShotRoundBytes in
#   signal.cuh; a CPU test keeps the two equal);
# - from TWOSHOT_MIN_WORLD ranks on, the others take the two-shot path (twoshot.cuh: each rank
#   reduces the rows it owns and writes them back to every peer: 2(P-1)/P of the partial over
#   NVLink per rank);
# - below it every rank pulls every row from every peer (the barrier path): at TP=2 the same
#   total bytes as a two-shot, with one barrier pair and no second pass.
ONESHOT_ROUND_BYTES = 8 << 20
TWOSHOT_MIN_WORLD = 4


def oneshot_applies(layout: Layout, world: int, rows: int, hidden: int, elem_bytes: int) -> bool:
    """Whether the CUDA op takes the one-shot path for this call (where the communicator's
    settings allow it)."""
    return layout is Layout.REPLICATED and world * rows * hidden * elem_bytes <= ONESHOT_ROUND_BYTES


def twoshot_applies(layout: Layout, world: int, rows: int, hidden: int, elem_bytes: int) -> bool:
    """Whether the CUDA op takes the two-shot path for this call (where the communicator's
    settings allow it and the one-shot path does not take it)."""
    return (layout is Layout.REPLICATED and world >= TWOSHOT_MIN_WORLD
            and not oneshot_applies(layout, world, rows, hidden, elem_bytes))


def check_kernel_args(partial: torch.Tensor, residual: torch.Tensor,
                      weight: torch.Tensor | None, residual_out: torch.Tensor,
                      normed_out: torch.Tensor | Fp8Rows | None, layout: Layout,
                      buffer: PeerBuffer, ctas: int) -> None:
    """Contract checks + kernel-specific ones; raise TokenWeaveInputError."""
    check_fused_args(partial, residual, weight, residual_out, normed_out, layout, buffer.world)
    if partial.dtype not in KERNEL_DTYPES:
        raise TokenWeaveInputError(f"the CUDA kernel takes bf16 or fp16, got {partial.dtype}")
    tensors = {"partial": partial, "residual": residual, "residual_out": residual_out}
    fp8 = isinstance(normed_out, Fp8Rows)
    if weight is not None:
        tensors.update(weight=weight, normed_out=normed_out.data if fp8 else normed_out)
    for name, t in tensors.items():
        if t.device != buffer.device:
            raise TokenWeaveInputError(
                f"{name} is on {t.device}, the symmetric buffer on {buffer.device}")
        if t.data_ptr() % VECTOR_BYTES:
            raise TokenWeaveInputError(f"{name} is not 16-byte aligned")
    if not isinstance(ctas, int) or not MIN_CTAS <= ctas <= MAX_CTAS:
        raise TokenWeaveInputError(f"ctas must be an int in [{MIN_CTAS}, {MAX_CTAS}], got {ctas!r}")
    if partial.shape[-1] > MAX_HIDDEN:
        raise TokenWeaveInputError(f"hidden {partial.shape[-1]} > {MAX_HIDDEN}")
    if not buffer.contains(partial):
        raise _partial_outside(partial, buffer, f"the symmetric buffer ({buffer.nbytes} bytes)")
    if fp8 and buffer.multicast_base:
        raise TokenWeaveInputError("FP8 normed rows are not written by the multimem path")
    if weight is not None and layout is Layout.SEQUENCE_PARALLEL:
        if not buffer.contains(normed_out):
            raise TokenWeaveInputError(
                f"normed_out (offset {buffer.offset_of(normed_out)}) is not inside the symmetric "
                f"buffer ({buffer.nbytes} bytes): sequence-parallel rows are stored to every peer")
        pitch = normed_out.stride(0) * normed_out.element_size()
        if normed_out.shape[0] > 1 and pitch % VECTOR_BYTES:
            raise TokenWeaveInputError("normed_out chunk stride must be a multiple of 16 bytes")


def _partial_outside(partial: torch.Tensor, buffer: PeerBuffer,
                     region: str) -> TokenWeaveInputError:
    return TokenWeaveInputError(
        f"partial (offset {buffer.offset_of(partial)}, "
        f"{partial.numel() * partial.element_size()} bytes) is not inside {region}")


# normed_scales and scaling of a call whose normed rows are in the activations' dtype.
_NO_SCALES: tuple[list[torch.Tensor], list[float]] = ([], [])
# The op's data paths (csrc/ops.cu Path): SM-driven kernels, or the copy-engine op.
PATHS = ("sm", "copy_engine")
# The op's `path` argument by (path, phase): the copy-engine op whole or one of its phases.
_PATH_CODES = {("sm", "whole"): 0, ("copy_engine", "whole"): 1,
               ("copy_engine", "transfer"): 2, ("copy_engine", "reduce"): 3}


def call_tag(call: int, *signature: int) -> int:
    """The 31-bit, nonzero tag of a call: the caller's number for it (`call`: the same on every
    rank for the same call, e.g. the woven layer's layer, stage and half) and the call's shape
    (`signature`), so ranks whose calls diverged publish different tags. Python's hash of a
    tuple of ints, which is the same in every process (hash randomization covers str and bytes
    only)."""
    return hash((call, *signature)) & 0x7FFFFFFF or 1


@dataclass(frozen=True)
class KernelSettings:
    """Protocol settings of one communicator: every rank of the group must use the same.

    bulk: the bulk-copy pipeline where its stages fit (else, and on GPUs before sm_90, the
        register path).
    oneshot: the flagless one-shot path for small replicated calls (oneshot_applies).
    twoshot: the two-shot path for the other replicated calls at TP >= 4 (twoshot_applies;
        else every rank pulls every row).
    local_stores_only: benchmark diagnostic (results are WRONG): sequence-parallel normed rows
        are stored locally only, which measures what the remote stores cost.
    check_calls: the kernels check the call tags (a peer on another call is an error); off only
        to measure what the check costs (a benchmark diagnostic: ranks whose calls diverged
        may then combine rows of two calls).
    """

    bulk: bool = True
    oneshot: bool = True
    local_stores_only: bool = False
    twoshot: bool = True
    check_calls: bool = True

    @property
    def flags(self) -> int:
        """comm_create's flag bits (csrc/ops.cu Flags)."""
        return (int(self.bulk) | int(self.oneshot) << 1 | int(self.local_stores_only) << 2
                | int(self.twoshot) << 3 | int(self.check_calls) << 4)


class KernelComm:
    """The C++ communicator of one peer-mapped buffer (and, for the copy-engine path, its mirror).

    Every rank must create it with the same settings, call `run` with the same shapes, layout,
    ctas, path and phase, in the same order (one op in flight per buffer), and `close` it before
    the buffer. A kernel that times out records the error in the buffer's signal pad and writes
    NaN into its outputs; so does every later launch, until a new buffer replaces this one.
    """

    def __init__(self, buffer: PeerBuffer, settings: KernelSettings | None = None) -> None:
        load_extension()
        self.buffer = buffer
        self.settings = settings or KernelSettings()
        self.mirror: CopyEngineMirror | None = None
        self.handle = int(torch.ops.tokenweave.comm_create(
            buffer.bases, buffer.rank, buffer.world, buffer.local_base, buffer.nbytes,
            int(buffer.timeout_s * 1e9), self.settings.flags, int(buffer.multicast_base or 0)))
        self._op = torch.ops.tokenweave.fused_allreduce_rmsnorm.default
        self._reduce_owned = torch.ops.tokenweave.gemm_reduce_rmsnorm.default

    def attach_mirror(self, mirror: CopyEngineMirror) -> None:
        """Give the copy-engine path its mirror of the peers' partial region."""
        if mirror.buffer is not self.buffer:
            raise TokenWeaveInputError("the copy-engine mirror belongs to another symmetric buffer")
        torch.ops.tokenweave.comm_attach_mirror(
            self.handle, mirror.sources, mirror.mirror, self.buffer.peer_data, mirror.mirrors,
            mirror.nbytes)
        self.mirror = mirror

    def run(self, partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
            eps: float, residual_out: torch.Tensor, normed_out: torch.Tensor | None,
            layout: Layout, *, ctas: int = DEFAULT_CTAS, path: str = "sm",
            phase: Phase = "whole", call: int = 0, validate: bool = True) -> None:
        """y = sum_p partial_p[chunk] + residual -> residual_out; RMSNorm(y) * weight -> normed_out.

        Same contract as ops.reference.fused_allreduce_rmsnorm_reference (ops/validate.py), on the
        current CUDA stream, with no host sync and no allocation (CUDA-graph capturable).
        `partial` (and, in the sequence-parallel layout, `normed_out`) must be views of
        `buffer.local`. path: "sm" (one-shot, bulk or register kernels, by size and settings;
        multimem where the buffer has a multicast address) or "copy_engine" (peers' rows move by
        cudaMemcpyAsync into the mirror; `ctas` CTAs then only reduce and normalize local rows).
        phase: on the copy-engine path, "transfer" issues only the pull of the peers' rows (with
        its barriers) and "reduce" only the local reduction + norm, which must follow the
        transfer in stream order; "whole" both.
        call: the caller's number for this call, the same on every rank (call_tag).
        validate: check the arguments in Python first (the op's C++ checks always run).
        """
        if validate:
            self._check(partial, residual, weight, residual_out, normed_out, layout, ctas, path,
                        phase)
        code = _PATH_CODES[path, phase]
        tag = call_tag(call, code, ctas, *partial.shape, weight is not None)
        scales, scaling = _NO_SCALES
        if isinstance(normed_out, Fp8Rows):
            (scales, scaling), normed_out = normed_out.op_args(), normed_out.data
        self._op(self.handle, partial, residual, weight, float(eps), residual_out, normed_out,
                 ctas, code, tag, scales, scaling)

    def gemm_tag(self, call: int, seg: Segments, set_index: int, hidden: int) -> int:
        """The tag a GEMM-fused call's GEMM and consumer share (0: the check is off, as the
        consumer then sees it)."""
        if not self.settings.check_calls:
            return 0
        return call_tag(call, set_index, seg.first, seg.step, seg.rows, seg.total, seg.row0,
                        hidden)

    def reduce_owned(self, partial: torch.Tensor, residual: torch.Tensor,
                     weight: torch.Tensor | None, eps: float, residual_out: torch.Tensor,
                     normed_out: torch.Tensor | Fp8Rows | None, layout: Layout, seg: Segments,
                     set_index: int, *, ctas: int = DEFAULT_CTAS, call: int = 0,
                     validate: bool = True) -> None:
        """The GEMM-fused mechanism's consumer (gemm_reduce.cuh) for the call whose GEMM stored
        `seg` into inbox set `set_index` (attach_inbox first) with the same `call`: the fused
        op's contract for the outputs (FP8 normed rows included); `partial` is the call's
        [chunks, rows, hidden] region of the buffer (replicated: every owner's y rows land
        there). Where seg.release is "consumer", it first publishes this rank's tiles of the
        GEMM before it on the stream."""
        if validate:
            check_kernel_args(partial, residual, weight, residual_out, normed_out, layout,
                              self.buffer, ctas)
        hidden = partial.shape[-1]
        tag = self.gemm_tag(call, seg, set_index, hidden) or 1  # 1: unchecked
        scales, scaling = _NO_SCALES
        if isinstance(normed_out, Fp8Rows):
            (scales, scaling), normed_out = normed_out.op_args(), normed_out.data
        self._reduce_owned(self.handle, partial, residual, weight, float(eps), residual_out,
                           normed_out, [*seg.geometry(set_index, hidden), ctas, tag], scales,
                           scaling)

    def _check(self, partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
               residual_out: torch.Tensor, normed_out: torch.Tensor | None, layout: Layout,
               ctas: int, path: str, phase: Phase) -> None:
        if path not in PATHS:
            raise TokenWeaveInputError(f"path must be one of {PATHS}, got {path!r}")
        check_phase(phase, layout, weight)
        if phase != "whole" and path != "copy_engine":
            raise TokenWeaveInputError(f"phase {phase!r} needs the copy-engine data path")
        check_kernel_args(partial, residual, weight, residual_out, normed_out, layout,
                          self.buffer, ctas)
        if path == "copy_engine":
            if self.mirror is None:
                raise TokenWeaveInputError("the copy-engine path needs a mirror (attach_mirror)")
            if not self.mirror.covers(partial):
                raise _partial_outside(partial, self.buffer,
                                       f"the {self.mirror.nbytes} mirrored bytes of the buffer")

    def close(self) -> None:
        """Free the C++ object (the buffer and mirror stay the caller's)."""
        if self.handle:
            torch.ops.tokenweave.comm_destroy(self.handle)
            self.handle = 0
