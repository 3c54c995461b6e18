"""The communicating row-parallel GEMM, warp-specialized (ping-pong), for the calls where the
one-consumer kernel's epilogue shows (kernels/owner_gemm.py; the pick: ops.segments.tiles_for).

Same arguments, tile order, stores and flag protocol as owner_gemm.py's kernel; the difference
is who does what in a CTA:

- a producer warp issues the TMA loads of every tile of the CTA into a ring of `stages` slots
  (`ready[s]`: loaded, `empty[s]`: free again);
- two consumer warpgroups take the CTA's tiles in turn (0, 2, 4... and 1, 3, 5...), each a
  128 x 128 tile in its own registers: its MMAs, then its epilogue (bias, rounding, a layout
  change to 16-byte rows, stores into the owner's inbox) while the other consumer's MMAs run.
  A consumer starts a tile's MMAs only after the other issued its previous tile's (`turn`):
  the MMAs alternate, and a slot's barrier parity always names the load the waiter wants.

Why Gluon (Triton's explicit-layout dialect): the epilogue must overlap the next tile's MMAs,
which on Hopper takes warp specialization; Triton 3.6's automatic one does not apply to sm_90,
and Gluon gives it with the same Triton launcher, descriptors and device functions
(owner_protocol.py) as the one-consumer kernel. Measured on one H200 (docs/kernel.md,
"Ping-pong"): 1.02-1.10x of cuBLAS at 4K-8K tokens of the short-K shards, where owner_gemm.py's
kernel gave 0.92-0.99x; a system-scope fence in each consumer thread doubled the kernel's time
at 1K tokens, so only warp 0 fences, after both are done (the partitions' join orders every
consumer's stores).

No `from __future__ import annotations` here: Gluon's aggregates check field annotations as
types.
"""

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.language.core import _aggregate as aggregate

from megatron_tokenweave.kernels.owner_protocol import (
    PER_CALL,
    call_epoch,
    release_tiles,
    tile_destination,
    tile_of,
)
from megatron_tokenweave.ops.segments import GemmTiles

# Triton 3.6 names the TMA load async_copy_global_to_shared; later versions async_load.
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_PRODUCER_REGS = gl.constexpr(40)  # the load warp needs few registers ...
_CONSUMER_REGS = gl.constexpr(232)  # ... so a consumer holds its 128 x 128 fp32 tile and epilogue
_FLAG_LANES = gl.constexpr(32)  # flags stored at once after the join: a thread of warp 0 each


@aggregate
class _Settings:
    """Compile-time settings of a partition (constexprs passed to a partition as plain
    arguments would arrive as runtime values)."""

    consumer: gl.constexpr
    has_bias: gl.constexpr
    group_rows: gl.constexpr
    out_bf16: gl.constexpr
    scaled: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, consumer, has_bias, group_rows, out_bf16, scaled):
        self.consumer = gl.constexpr(consumer)
        self.has_bias = gl.constexpr(has_bias)
        self.group_rows = gl.constexpr(group_rows)
        self.out_bf16 = gl.constexpr(out_bf16)
        self.scaled = gl.constexpr(scaled)


@gluon.constexpr_function
def _row_layout(block_cols):
    """Each thread 8 consecutive elements (one 16-byte store), a row's across adjacent lanes."""
    per_row = min(32, block_cols // 8)
    return gl.BlockedLayout([1, 8], [32 // per_row, per_row], [4, 1], [1, 0])


@gluon.jit
def _producer(cfg, a_desc, b_desc, a_bufs, b_bufs, ready, empty, first, step, start, blocks,
              num_m, per_group, tiles, num_ctas, k_tiles):
    """TMA loads of every (tile, K step) of this CTA, in order, one ring slot each."""
    stages: gl.constexpr = a_bufs.shape[0]
    bm: gl.constexpr = a_desc.block_type.shape[0]
    bk: gl.constexpr = a_desc.block_type.shape[1]
    bn: gl.constexpr = b_desc.block_type.shape[0]
    nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    pos = 0
    for tile in range(gl.program_id(0), tiles, num_ctas):
        owner, m, pn = tile_of(tile, start, blocks, num_m, per_group, cfg.group_rows)
        row = first + owner * step + m * bm
        for kt in range(k_tiles):
            slot = pos % stages
            mbarrier.wait(empty.index(slot), ((pos // stages) & 1) ^ 1)
            mbarrier.expect(ready.index(slot), nbytes)
            _tma_load(a_desc, [row, kt * bk], ready.index(slot), a_bufs.index(slot))
            _tma_load(b_desc, [pn * bn, kt * bk], ready.index(slot), b_bufs.index(slot))
            pos += 1


@gluon.jit
def _consumer(cfg, a_bufs, b_bufs, ready, empty, turn, bias_ptr, xs_ptr, ws_ptr, r0, r1, r2, r3,
              r4, r5, r6, r7, slots_off, rank, slot_rows, row0, seg_rows, total, start, blocks,
              num_m, per_group, tiles, num_ctas, k_tiles, N):
    """Tiles cfg.consumer, cfg.consumer + 2, ... of this CTA: MMAs in turn with the other
    consumer, then the epilogue into the owner's inbox slot `rank` (cfg.scaled: e4m3
    operands, the accumulator times their two per-tensor scales first)."""
    c: gl.constexpr = cfg.consumer
    stages: gl.constexpr = a_bufs.shape[0]
    bm: gl.constexpr = a_bufs.shape[1]
    bn: gl.constexpr = b_bufs.shape[1]
    out_dtype: gl.constexpr = gl.bfloat16 if cfg.out_bf16 else gl.float16
    # An MMA's depth is 32 bytes of K: 16 elements of 16 bits, 32 of e4m3.
    mma_k: gl.constexpr = 32 if cfg.scaled else 16
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, bn, mma_k])
    row_layout: gl.constexpr = _row_layout(bn)
    rows = gl.arange(0, bm, layout=gl.SliceLayout(1, row_layout))
    cols = gl.arange(0, bn, layout=gl.SliceLayout(0, row_layout))
    acc_cols = gl.arange(0, bn, layout=gl.SliceLayout(0, mma))
    local = c  # the tile's index among this CTA's; its K steps: ring positions from local * k_tiles
    for tile in range(gl.program_id(0) + c * num_ctas, tiles, 2 * num_ctas):
        owner, m, pn = tile_of(tile, start, blocks, num_m, per_group, cfg.group_rows)
        pos = local * k_tiles
        acc = gl.zeros((bm, bn), dtype=gl.float32, layout=mma)
        turns = (local - c) // 2 + c - 1  # the other consumer's finished turns to wait for
        mbarrier.wait(turn.index(c), turns & 1, pred=turns >= 0)
        for kt in range(k_tiles):
            slot = pos % stages
            mbarrier.wait(ready.index(slot), (pos // stages) & 1)
            acc = warpgroup_mma(a_bufs.index(slot), b_bufs.index(slot).permute((1, 0)), acc,
                                is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            mbarrier.arrive(empty.index((pos + stages - 1) % stages), pred=kt > 0)
            pos += 1
        mbarrier.arrive(turn.index(1 - c))
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index((pos + stages - 1) % stages))
        local += 2
        if cfg.scaled:
            acc = acc * (gl.load(xs_ptr) * gl.load(ws_ptr))
        if cfg.has_bias:
            bias = gl.load(bias_ptr + pn * bn + acc_cols, mask=pn * bn + acc_cols < N)
            acc = acc + bias.to(gl.float32)[None, :]
        out = gl.convert_layout(acc.to(out_dtype), row_layout)
        dst, valid = tile_destination(owner, m, pn, seg_rows, total, r0, r1, r2, r3, r4, r5, r6,
                                      r7, slots_off, rank, slot_rows, row0, N, out_dtype, bm, bn)
        gl.store(dst + (rows.to(gl.int64) * N)[:, None] + cols[None, :], out,
                 mask=(rows < valid)[:, None] & (pn * bn + cols < N)[None, :])


@gluon.jit(do_not_specialize=PER_CALL)
def _pingpong_kernel(
    a_desc, b_desc, bias_ptr, xs_ptr, ws_ptr, control_ptr, r0, r1, r2, r3, r4, r5, r6, r7,
    slots_off, tags_off,
    rank, set_index, call_tag, set_words, flag_blocks, flag_tiles,
    first, step, seg_rows, total, row0, slot_rows, num_m, start, N, K, num_ctas,
    HAS_BIAS: gl.constexpr, OUT_BF16: gl.constexpr, SCALED: gl.constexpr, GROUP_M: gl.constexpr,
    STAGES: gl.constexpr, RELEASE: gl.constexpr,
):
    """SCALED: e4m3 operands scaled per tensor (xs_ptr, ws_ptr: their scale_inv [1]), else
    bf16/fp16 ones (the scale pointers unused); the rows land in bf16 (OUT_BF16) or fp16."""
    bm: gl.constexpr = a_desc.block_type.shape[0]
    bk: gl.constexpr = a_desc.block_type.shape[1]
    bn: gl.constexpr = b_desc.block_type.shape[0]
    epoch = call_epoch(control_ptr, set_index)
    blocks = gl.cdiv(seg_rows, bm)
    k_tiles = gl.cdiv(K, bk)
    per_group = GROUP_M * gl.cdiv(N, bn)
    tiles = num_m * gl.cdiv(N, bn)
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, bm, bk], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, bn, bk], b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    consumer_args = (a_bufs, b_bufs, ready, empty, turn, bias_ptr, xs_ptr, ws_ptr, r0, r1, r2,
                     r3, r4, r5, r6, r7, slots_off, rank, slot_rows, row0, seg_rows, total, start,
                     blocks, num_m, per_group, tiles, num_ctas, k_tiles, N)
    gl.warp_specialize([
        (_consumer, (_Settings(0, HAS_BIAS, GROUP_M, OUT_BF16, SCALED),) + consumer_args),
        (_consumer, (_Settings(1, HAS_BIAS, GROUP_M, OUT_BF16, SCALED),) + consumer_args),
        (_producer, (_Settings(0, HAS_BIAS, GROUP_M, OUT_BF16, SCALED), a_desc, b_desc, a_bufs,
                     b_bufs, ready, empty, first, step, start, blocks, num_m, per_group, tiles,
                     num_ctas, k_tiles)),
    ], [4, 1], [_CONSUMER_REGS, _PRODUCER_REGS])
    # Publish once per CTA, as owner_gemm.py's kernel: the partitions' join is the barrier
    # that orders every consumer's stores before warp 0's fence.
    if RELEASE:
        release_tiles(gl.arange(0, _FLAG_LANES, layout=gl.BlockedLayout([1], [32], [4], [0])),
                      tiles, epoch, start, blocks, num_m, per_group, GROUP_M, r0, r1, r2, r3, r4,
                      r5, r6, r7, tags_off, rank, set_index, call_tag, set_words, flag_blocks,
                      flag_tiles, num_ctas)


_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16,
              torch.float8_e4m3fn: gl.float8e4nv}


@functools.cache
def _smem_layout(rows: int, cols: int, dtype: torch.dtype) -> gl.NVMMASharedLayout:
    """An operand tile's shared-memory layout, built once per shape and dtype rather than on
    every call (host time of eager forwards, docs/kernel.md)."""
    return gl.NVMMASharedLayout.get_default_for([rows, cols], _GL_DTYPES[dtype])


def launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, grid: int,
           protocol: tuple, tiles: GemmTiles, release: bool, out_dtype: torch.dtype,
           scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Queue the kernel: `protocol` holds owner_gemm.py's kernel arguments from control_ptr on
    (the same for both kernels); `tiles` a consumer's tile and the pipeline (PINGPONG, or its
    FP8 form); release: owner_gemm's; out_dtype: the inbox's; scales: e4m3 operands' per-tensor
    scale_inv (x's, the weight's)."""
    bm, bn, bk = tiles.block_rows, tiles.block_cols, tiles.block_k
    a_desc = TensorDescriptor.from_tensor(x, [bm, bk], _smem_layout(bm, bk, x.dtype))
    b_desc = TensorDescriptor.from_tensor(weight, [bn, bk], _smem_layout(bn, bk, x.dtype))
    xs, ws = scales if scales is not None else (weight, weight)
    _pingpong_kernel[(grid,)](a_desc, b_desc, bias if bias is not None else weight, xs, ws,
                              *protocol, HAS_BIAS=bias is not None,
                              OUT_BF16=out_dtype == torch.bfloat16, SCALED=scales is not None,
                              GROUP_M=tiles.group_rows, STAGES=tiles.stages, RELEASE=release,
                              num_warps=tiles.warps)
