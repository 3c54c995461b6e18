"""The communicating row-parallel GEMM: partial = x @ W^T (+ bias on one rank), whose epilogue
stores every output tile straight into the inbox of the rank that owns its rows and (where
ops/segments.release_for says the GEMM releases) publishes it with an epoch-tagged flag, after
the call's tag, so the reduce-scatter happens inside the GEMM, on no extra SMs.

Why Triton: a persistent Triton GEMM with TMA loads ran the row-parallel shapes of Llama-70B
at 0.97-1.07x of cuBLAS on an H200 before any epilogue work, and its epilogue is ordinary code
we own (16-byte stores to any rank's mapped address, a fence and flag stores), where cuBLAS's
epilogue is closed and a CUTLASS collective would need a custom epilogue visitor per layout.
docs/kernel.md has the measurements that shaped it: the warp-specialized
owner_gemm_pingpong.py takes the calls where it measured faster (ops/segments.tiles_for); a
system-scope fence per tile cost 5-10 %, so each CTA publishes the flags of all its tiles once,
after its last tile, and where a CTA has at most two LARGE tiles' worth of work even that
(~1 us) is left to the consumer. Tile shapes and geometry:
ops/segments.py; the consumer: csrc/include/tokenweave/gemm_reduce.cuh.

Tile order: persistent CTAs walk (row block, column tile) pairs grouped by `group_rows` row
blocks (weight tiles reused in L2), over the call's non-empty row blocks from segment rank + 1's
on (each rank writes a different peer first). The GEMM never waits: its stores into a set's
rows are ordered after that set's previous consumer by the caller (the woven schedule's data
dependencies), and that consumer's END barrier means every owner finished reading them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from megatron_tokenweave.kernels.inbox import GemmInbox
from megatron_tokenweave.kernels.owner_gemm_pingpong import launch as launch_pingpong
from megatron_tokenweave.kernels.owner_protocol import (
    PER_CALL,
    call_epoch,
    release_tiles,
    tile_destination,
    tile_of,
)
from megatron_tokenweave.ops.fp8_operands import Fp8Operands
from megatron_tokenweave.ops.fp8_rows import FP8_DTYPE
from megatron_tokenweave.ops.segments import (
    FIT_MAX_ROWS,
    FIT_MIN_ROWS,
    FIT_TOKENS_M_EXTENTS,
    FIT_TOKENS_M_ROWS,
    FP8_BLOCK_K,
    Segments,
    fit_max_rows,
)
from megatron_tokenweave.ops.validate import (
    KERNEL_DTYPES,
    MAX_RANKS,
    VECTOR_BYTES,
    VECTOR_ELEMS,
    TokenWeaveInputError,
    check_gemm_operands,
)


@triton.jit
def _store_tile(dst, acc, bias_ptr, valid_rows, col0, N, HAS_BIAS: tl.constexpr,
                ROWS: tl.constexpr, WIDTH: tl.constexpr):
    """The first valid_rows rows x columns col0 .. col0 + WIDTH (< N) of a tile part, bias
    added, rounded once; dst points at the part's first row and column."""
    rows = tl.arange(0, ROWS)
    cols = tl.arange(0, WIDTH)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + col0 + cols, mask=col0 + cols < N).to(tl.float32)[None, :]
    tl.store(dst + (rows.to(tl.int64) * N)[:, None] + cols[None, :], acc.to(dst.dtype.element_ty),
             mask=(rows < valid_rows)[:, None] & (col0 + cols < N)[None, :])


@triton.jit
def _block_scales(xs_ptr, ws_ptr, xs_stride, ws_stride, x_row, x_rows, pn, kt, N,
                  BM: tl.constexpr, BN: tl.constexpr):
    """K block kt's scales of a tile's rows (1 x 128 blocks of x) and columns (128 x 128
    blocks of the weight), ops/fp8_operands.py's layouts; rows and columns past x's or the
    weight's end get 0."""
    rows = x_row + tl.arange(0, BM)
    cols = pn * BN + tl.arange(0, BN)
    xs = tl.load(xs_ptr + kt * xs_stride + rows, mask=rows < x_rows, other=0.0)
    ws = tl.load(ws_ptr + (cols // 128) * ws_stride + kt, mask=cols < N, other=0.0)
    return xs[:, None] * ws[None, :]


@triton.jit(do_not_specialize=(*PER_CALL, "xs_stride", "x_rows"))
def _owner_gemm_kernel(
    a_desc, b_desc, bias_ptr, xs_ptr, ws_ptr, xs_stride, ws_stride, x_rows,
    control_ptr, r0, r1, r2, r3, r4, r5, r6, r7, slots_off, tags_off,
    rank, set_index, call_tag, set_words, flag_blocks, flag_tiles,
    first, step, seg_rows, total, row0, slot_rows, num_m, start, N, K, num_ctas,
    HAS_BIAS: tl.constexpr, OUT_BF16: tl.constexpr, SCALES: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    HALVES: tl.constexpr, FLAG_LANES: tl.constexpr, RELEASE: tl.constexpr,
):
    """SCALES: 0 for bf16/fp16 operands; FP8 ones scaled per tensor (1: the accumulator times
    both scales once) or per block (2: each K block's product times its rows' and columns'
    scales; BK = 128)."""
    out_dtype: tl.constexpr = tl.bfloat16 if OUT_BF16 else tl.float16
    epoch = call_epoch(control_ptr, set_index)
    blocks = tl.cdiv(seg_rows, BM)
    num_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    per_group = GROUP_M * num_n
    if SCALES == 1:
        scale = tl.load(xs_ptr) * tl.load(ws_ptr)
    # Flattened (tile, K) loop: the next tile's loads are in flight during this tile's epilogue.
    # Only non-empty row blocks are tiles (num_m of them); rows past a segment's end in its last
    # block are computed and masked off.
    for tile in tl.range(tl.program_id(0), num_m * num_n, num_ctas, flatten=True):
        owner, m, pn = tile_of(tile, start, blocks, num_m, per_group, GROUP_M)
        x_row = first + owner * step + m * BM
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kt in range(k_tiles):
            a = a_desc.load([x_row, kt * BK])
            b = b_desc.load([pn * BN, kt * BK])
            if SCALES == 2:
                acc += tl.dot(a, b.T) * _block_scales(xs_ptr, ws_ptr, xs_stride, ws_stride,
                                                      x_row, x_rows, pn, kt, N, BM, BN)
            else:
                acc = tl.dot(a, b.T, acc)
        if SCALES == 1:
            acc = acc * scale
        dst, valid = tile_destination(owner, m, pn, seg_rows, total, r0, r1, r2, r3, r4, r5, r6,
                                      r7, slots_off, rank, slot_rows, row0, N, out_dtype, BM, BN)
        if HALVES:  # two column halves: half the store addresses live at once
            left, right = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1)))
            _store_tile(dst, left, bias_ptr, valid, pn * BN, N, HAS_BIAS, BM, BN // 2)
            _store_tile(dst + BN // 2, right, bias_ptr, valid, pn * BN + BN // 2, N,
                        HAS_BIAS, BM, BN // 2)
        else:
            _store_tile(dst, acc, bias_ptr, valid, pn * BN, N, HAS_BIAS, BM, BN)
    # Publish once per CTA, after its last tile; the flags' addresses are computed, not loaded
    # (a serial loop of loads and stores here cost 2-4 % of short GEMMs, measured).
    if RELEASE:
        tl.debug_barrier()
        release_tiles(tl.arange(0, FLAG_LANES), num_m * num_n, epoch, start, blocks, num_m,
                      per_group, GROUP_M, r0, r1, r2, r3, r4, r5, r6, r7, tags_off, rank,
                      set_index, call_tag, set_words, flag_blocks, flag_tiles, num_ctas)


def owner_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               inbox: GemmInbox, seg: Segments, set_index: int, ctas: int, tag: int,
               validate: bool = True, fp8: Fp8Operands | None = None) -> None:
    """Queue the GEMM on the current stream. x: [rows, K] (every chunk's rows, each row
    contiguous, rows a multiple of 16 bytes apart: `check_gemm_operands`; the segments say
    which rows each owner gets); weight: [hidden, K]; bias: [hidden] or None;
    ctas: persistent CTAs (the SMs left to the GEMM); tag: the call's tag (31 bits), which its
    consumer passes too: published into each owner's inbox before the flags, the owner gives
    up on a source's tiles of another call. The segments' tiles pick the kernel:
    this module's, or the ping-pong one (owner_gemm_pingpong.py) where it measured faster, or
    the fitted CUDA kernel (its consumer publishes the rows and the tag; 16-bit operands or
    e4m3 ones scaled per tensor or in blocks, in blocks also with the tokens as the MMA's M:
    ops/segments.fit_tiles(tokens_m=True)).
    seg.release says who publishes the tiles: these CTAs after their last tile ("gemm"), or
    the consumer after this kernel ("consumer": no fence, no flags here). validate: check a
    fitted call or FP8 operands first (`check_fitted_gemm`, `Fp8Operands.check`; off where
    the caller checked them already).
    fp8: x and weight are e4m3 with these scales (ops/fp8_operands.py; FP8 tiles,
    ops/segments.tiles_for(fp8=fp8.scaling)); the tiles land in the inbox's dtype."""
    if fp8 is not None:
        if seg.tiles.block_k != FP8_BLOCK_K or (
                fp8.blocks and seg.tiles.consumers != 1 and not seg.tiles.fitted):
            raise TokenWeaveInputError(
                f"FP8 operands take tiles with {FP8_BLOCK_K}-deep K blocks, block scales the "
                f"one-consumer or fitted kernel's (segments(..., fp8={fp8.scaling!r})), got "
                f"{seg.tiles}")
        if validate:
            fp8.check(x, weight)
    num_m = seg.nonempty_blocks(inbox.world)
    if num_m == 0:  # no rows: no kernel, no flags (the consumer of an empty call does nothing)
        return
    if seg.tiles.fitted:  # the CUDA kernel (csrc/include/tokenweave/fit_gemm.cuh)
        if validate:
            check_fitted_gemm(x, weight, bias, seg, inbox.slot_rows, inbox.world,
                              None if fp8 is None else fp8.scaling, inbox.dtype, ctas=ctas)
        torch.ops.tokenweave.fit_gemm(
            x, weight, bias, inbox.bases,
            seg.fitted_geometry(inbox.slots_off, inbox.rank, inbox.slot_rows, inbox.world), ctas,
            [] if fp8 is None else [fp8.x_scale_inv, fp8.w_scale_inv], inbox.dtype,
            inbox.split_work(set_index) if seg.tiles.split_tiles else [])
        return
    t, release = seg.tiles, seg.release == "gemm"
    grid = max(1, min(ctas, num_m * t.col_tiles(weight.shape[0])))
    start = (inbox.rank + 1) % inbox.world * seg.blocks()
    regions = inbox.bases + [inbox.bases[0]] * (MAX_RANKS - inbox.world)
    protocol = (inbox.control, *regions, inbox.slots_off, inbox.tags_off, inbox.rank, set_index,
                tag, inbox.set_words, inbox.flag_blocks, inbox.flag_tiles,
                seg.first, seg.step, seg.rows, seg.total, seg.row0, inbox.slot_rows, num_m,
                start, weight.shape[0], weight.shape[1], grid)
    if t.consumers == 2:
        launch_pingpong(x, weight, bias, grid, protocol, t, release, inbox.dtype,
                        None if fp8 is None else (fp8.x_scale_inv, fp8.w_scale_inv))
        return
    a_desc = TensorDescriptor.from_tensor(x, [t.block_rows, t.block_k])
    b_desc = TensorDescriptor.from_tensor(weight, [t.block_cols, t.block_k])
    scales = (0, weight, weight, 0, 0) if fp8 is None else (
        2 if fp8.blocks else 1, fp8.x_scale_inv, fp8.w_scale_inv,
        fp8.x_scale_inv.stride(0), fp8.w_scale_inv.stride(0))
    _owner_gemm_kernel[(grid,)](
        a_desc, b_desc, bias if bias is not None else weight, *scales[1:], x.shape[0],
        *protocol, HAS_BIAS=bias is not None, OUT_BF16=inbox.dtype == torch.bfloat16,
        SCALES=scales[0],
        BM=t.block_rows, BN=t.block_cols, BK=t.block_k, GROUP_M=t.group_rows,
        HALVES=t.block_cols >= 256, FLAG_LANES=32, RELEASE=release, num_warps=t.warps,
        num_stages=t.stages)


def check_fitted_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      seg: Segments, slot_rows: int, world: int, fp8: str | None = None,
                      out_dtype: torch.dtype | None = None, *, ctas: int) -> None:
    """Raise TokenWeaveInputError for a call the fitted kernel cannot take (ops.cu checks the
    same again, as the last line of defence): bf16/fp16 operands of the rows' dtype (out_dtype,
    x's by default), or e4m3 ones scaled as fp8 names (ops/segments.FP8_SCALINGS; their
    scales are Fp8Operands.check's), 16-byte rows, row pitches and starts, its token extents
    (up to FIT_WIDE_MAX_ROWS in blocks and in the cooperative mode outside pairs, else
    FIT_MAX_ROWS; with the tokens as M, in blocks only, its weight
    extents FIT_TOKENS_M_EXTENTS and FIT_TOKENS_M_ROWS tokens a consumer; pairs of CTAs in the
    cooperative mode, not in blocks, on at least 2 CTAs), the rows the segments read and the
    inbox rows they fill. A tile's rows past x's are read as zeros (its tensor
    map ends there) and never stored, so x needs no rows past the call's."""
    out_dtype = out_dtype or x.dtype
    operand = FP8_DTYPE if fp8 else out_dtype
    if out_dtype not in KERNEL_DTYPES or x.dtype != operand or weight.dtype != operand or (
            bias is not None and bias.dtype != out_dtype):
        operands = "e4m3 operands with" if fp8 else "x, weight,"
        raise TokenWeaveInputError(
            f"the fitted GEMM takes {operands} rows and bias of one dtype, bf16 or fp16 (the "
            f"rows': {out_dtype}), got x {x.dtype}, weight {weight.dtype}, bias "
            f"{None if bias is None else bias.dtype}")
    n, k = weight.shape if weight.dim() == 2 else (0, 0)
    k_align = VECTOR_BYTES // x.element_size()  # rows of x and the weight in whole vectors
    if x.dim() != 2 or x.shape[1] != k or k % k_align or n % VECTOR_ELEMS:
        raise TokenWeaveInputError(
            f"the fitted GEMM needs x [rows, K] and weight [N, K] with K a multiple of "
            f"{k_align} and N of {VECTOR_ELEMS}, got {tuple(x.shape)} and "
            f"{tuple(weight.shape)}")
    check_gemm_operands(x, weight, "the fitted GEMM")
    if bias is not None and tuple(bias.shape) != (n,):
        raise TokenWeaveInputError(f"bias must be [{n}], got {tuple(bias.shape)}")
    if x.data_ptr() % VECTOR_BYTES or weight.data_ptr() % VECTOR_BYTES:
        raise TokenWeaveInputError("the fitted GEMM's x and weight must start 16-byte aligned")
    t = seg.tiles
    bn = t.block_rows
    most = fit_max_rows(t.cooperative, fp8 == "blocks", t.pair)
    wide = most > FIT_MAX_ROWS
    if t.tokens_m:
        if fp8 != "blocks" or t.block_cols not in FIT_TOKENS_M_EXTENTS or bn != (
                FIT_TOKENS_M_ROWS * (2 if t.cooperative else 1)):
            raise TokenWeaveInputError(
                f"the fitted GEMM's tokens as M take e4m3 operands in blocks (got "
                f"{fp8 or out_dtype}), weight extents {FIT_TOKENS_M_EXTENTS} and "
                f"{FIT_TOKENS_M_ROWS} tokens a consumer, got tiles {t}")
    elif bn % 8 or not FIT_MIN_ROWS <= bn <= most:
        raise TokenWeaveInputError(
            f"the fitted GEMM's tiles hold a multiple of 8 tokens in {FIT_MIN_ROWS}..{most}"
            f"{' (block scales)' if fp8 == 'blocks' else ' (cooperative)' if wide else ''}, "
            f"got {bn}")
    if t.pair and (not t.cooperative or t.tokens_m or fp8 == "blocks" or ctas < 2):
        raise TokenWeaveInputError(
            f"the fitted GEMM's pairs of CTAs take its cooperative mode, 16-bit or per-tensor "
            f"operands and at least 2 CTAs, got tiles {t}, {fp8 or out_dtype}, {ctas} CTAs")
    if t.split_tiles and (not t.cooperative or t.pair or t.tokens_m or fp8 == "blocks"
                          or t.split_tiles > seg.tile_count(world, n)
                          or seg.split_ctas(k) > ctas):
        raise TokenWeaveInputError(
            f"the fitted GEMM's split K takes its cooperative mode outside pairs, 16-bit or "
            f"per-tensor operands, no more tiles than the call's and no more CTAs than given "
            f"({ctas}), got tiles {t}, {fp8 or out_dtype}")
    last = seg.input_rows(world)
    if last > x.shape[0] or seg.row0 + seg.rows > slot_rows:
        raise TokenWeaveInputError(
            f"the segments read x rows up to {last} (x has {x.shape[0]}) and fill inbox rows "
            f"up to {seg.row0 + seg.rows} (a slot has {slot_rows})")
