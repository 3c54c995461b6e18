"""Where the communicating row-parallel GEMM's output rows go (the GEMM-fused mechanism).

The rows of one call (one half of the woven schedule, or all rows) are split into P segments and
rank c owns segment c: every rank's GEMM stores its partial rows of segment c into rank c's
inbox, slot = its own rank, and rank c reduces them (csrc/include/tokenweave/gemm_reduce.cuh).

- sequence parallel: segment c is chunk c's rows of the half (Megatron's shard of rank c), so the
  owner reduces exactly the rows it keeps;
- replicated: the half's rows cut into P runs of `rows` rows (the last runs may be short or
  empty): for the Triton kernels a whole number of their block rows, so only the last non-empty
  run has a partial block (the GEMM computes no rows it throws away elsewhere); for the fitted
  CUDA kernel, whose tiles need not align with segments, ceil(rows / P).

Pure Python: the GEMM launchers (Triton, and the fitted kernel's op), the consumer's arguments
and the CPU emulation (ops/gemm_emulation.py) all take their geometry from here.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

from megatron_tokenweave.ops.gemm_rows import whole_boxes
from megatron_tokenweave.ops.validate import Layout, TokenWeaveInputError

# One flag per (source, block of BLOCK_ROWS rows, column tile of BLOCK_COLS): the inbox sizes its
# flag array for the smallest tiles the GEMM takes.
MIN_BLOCK_ROWS = 64
MIN_BLOCK_COLS = 128
MAX_BLOCK_ROWS = 128
SETS = 2  # inbox sets: the woven schedule's halves (half B's GEMM beside half A's consumer)


@dataclass(frozen=True)
class GemmTiles:
    """The GEMM's tile shape and pipeline, and (one-consumer tiles, which `estimated_time`
    compares) its throughput relative to LARGE's where both fill whole waves of CTAs (H200,
    docs/kernel.md). consumers = 2 is the warp-specialized ping-pong kernel
    (kernels/owner_gemm_pingpong.py): two warpgroups each computing a whole tile, one's epilogue
    beside the other's MMAs; warps is then per consumer. `tiles_for` picks it by a measured
    rule, not by efficiency."""

    block_rows: int
    block_cols: int
    block_k: int
    stages: int
    warps: int
    efficiency: float = 1.0
    group_rows: int = 8  # row blocks per group of the tile order (weight tiles reused in L2)
    consumers: int = 1
    fitted: bool = False  # the CUDA kernel with tiles fitted to the call (`fitted_tiles`)
    cooperative: bool = False  # fitted: both consumers on one tile (`fit_tile_rows`)
    tokens_m: bool = False  # fitted, e4m3 in blocks: the tokens as the MMA's M (`fit_tiles`)
    pair: bool = False  # fitted, cooperative, not in blocks: clusters of two CTAs (`fit_tiles`)
    # fitted, cooperative, not in pairs or blocks: split K of the last split_tiles tiles of a
    # call, split_steps of their K steps a CTA (`split_k_tiles`)
    split_tiles: int = 0
    split_steps: int = 0

    def col_tiles(self, hidden: int) -> int:
        return -(-hidden // self.block_cols)


LARGE = GemmTiles(block_rows=128, block_cols=256, block_k=64, stages=4, warps=8, efficiency=1.0)
WIDE = GemmTiles(block_rows=64, block_cols=256, block_k=64, stages=4, warps=4, efficiency=0.9)
SMALL = GemmTiles(block_rows=64, block_cols=128, block_k=64, stages=4, warps=4, efficiency=0.6)
PINGPONG = GemmTiles(block_rows=128, block_cols=128, block_k=64, stages=6, warps=4, consumers=2)
TILES = {"large": LARGE, "wide": WIDE, "small": SMALL, "pingpong": PINGPONG}  # by name
ONE_CONSUMER = (LARGE, WIDE, SMALL)  # the one-consumer Triton kernel's tiles
# FP8 (e4m3) operands: tiles with 128-deep K blocks, the same bytes per stage as the 16-bit
# tiles' 64 and the blockwise recipe's scale block (ops/fp8_operands.py). Scaled per tensor
# ("tensor") the 16-bit pick, the ping-pong kernel (measured faster than the one-consumer tiles
# at 211 of the 250 Llama-shard points where the 16-bit rules pick it, one H200, docs/kernel.md
# "FP8 operands"), and the fitted kernel where FIT_BELOW says so or, over more than
# FIT_FP8_MIN_K in-features, where it runs its ping-pong mode (long K loops of many tiles per
# CTA: there 1.10x the Triton kernel at the median of 219 points, Qwen2.5-72B's fc2 at TP 8
# aside, one H100, docs/results/gemm_fused_1gpu_fp8.json), except over more than
# FP8_PARTIAL_BOX_MIN_K in-features whose rows, as the GEMM gets them (ops/gemm_rows.py), are
# not whole 128-byte TMA boxes apart: there the one-consumer tiles, with or without the fitted
# kernel, but where its wave rule takes the call (Qwen2.5-72B's fc2 at TP 2 and 4, K = 14784
# and 7392, 1000-16K tokens but 1279, 18 counts each: the picks, the fitted kernel's ping-pong
# mode or the Triton ping-pong kernel, 0.76-0.99x of cuBLAS, the Triton ping-pong kernel alone
# 0.62-0.94x, the one-consumer kernel 0.93-1.03x, faster at 71 of 72 points of two sweeps,
# one H100, 2026-12-06; at 1279 tokens 0.79-0.89x against the ping-pong pick's 0.87-0.93x; at
# K = 2368, Qwen2.5-7B's fc2 at TP 8, the fitted kernel stays the faster); in blocks
# ("blocks") the fitted kernel's cooperative mode where it runs, with token extents up to
# FIT_BLOCKS_PICK_MAX_ROWS, or up to FIT_WIDE_MAX_ROWS where those take at most
# FIT_BLOCKS_WIDE_MAX_WAVES waves and no more than the narrower ones (`blocks_tiles`; 1.59x the
# one-consumer Triton kernel at the median of 414 points, faster at all, the ping-pong mode
# faster at 19, by 1-6 %, one H100, 2026-12-06; the wide tiles of one or two waves faster than
# the narrower pick at 66 of 98 points, 1.03x at the median, one H200, 2026-12-06,
# docs/results/gemm_fused_1gpu_fp8_blocks.json; calls under 512 tokens not timed), else the
# one-consumer tiles (the Triton kernels that scale each K block's product before adding it).
FP8_BLOCK_K = 128
FP8_SCALINGS = ("tensor", "blocks")
# When the ping-pong kernel wins (one H200, docs/kernel.md "Ping-pong"): its tiles per CTA
# (128 x 128 tiles / CTAs) at least PINGPONG_MIN_TILES, or PINGPONG_MIN_TILES_SHORT_K for
# in-features up to PINGPONG_MAX_K (short K loops, where the one-consumer kernels' epilogue is
# a large share of a tile: there two tiles per CTA already overlap one's epilogue with the
# other's MMAs).
PINGPONG_MAX_K = 2048
PINGPONG_MIN_TILES_SHORT_K = 1.5
PINGPONG_MIN_TILES = 3
# Who publishes a call's tiles (the consumer's flags say they landed):
# - "gemm": each GEMM CTA after its last tile, one epoch flag per (row block, column tile), so
#   an owner may reduce a row block before the last peer's GEMM ends;
# - "consumer": the GEMM stores tiles only; every rank's consumer, which its stream starts after
#   the GEMM ends, first publishes one flag per owner (csrc/include/tokenweave/gemm_reduce.cuh).
# The GEMM's release (the wait for its last stores, a system-scope fence, the flag stores) is a
# fixed ~1 us that no work overlaps; where a CTA has at most CONSUMER_RELEASE_MAX_WORK LARGE
# tiles' worth of work it costs up to 9 % of the GEMM (docs/kernel.md, "At 1K tokens"), and
# per-block readiness buys little there (a CTA's few tiles are released together, at its end).
RELEASES = ("gemm", "consumer")
CONSUMER_RELEASE_MAX_WORK = 2.0
# The fitted kernel (csrc/include/tokenweave/fit_gemm.cuh, sm_90): tiles of 128 weight rows
# (ping-pong) or 256 (cooperative) by any multiple of 8 tokens in FIT_MIN_ROWS..FIT_MAX_ROWS,
# and of 64 / 128 weight rows to FIT_WIDE_MAX_ROWS tokens (64-row consumers: cooperative past
# FIT_MAX_ROWS, in blocks past FIT_BLOCKS_HALVES_MAX_ROWS in both modes; `fit_tile_rows`),
# its consumer releasing the rows; 16-bit operands, or e4m3 ones scaled per tensor or in blocks
# (the pick in blocks: `blocks_tiles`). Measured
# on one H200 (docs/kernel.md, "The fitted kernel"):
# - the token extent: the fewest waves x (extent + FIT_TILE_COST), a tile's fixed cost in tokens
#   (the largest extent on ties: fewer, fuller tiles);
# - cooperative where its tiles take at most FIT_COOP_MAX_WAVES waves of at least
#   FIT_COOP_MIN_ROWS tokens (one or two long tiles a CTA: the smaller operand traffic pays,
#   the epilogue not overlapped costs little), else ping-pong;
# - the fitted kernel instead of the Triton pick, for calls of at least FIT_MIN_CALL rows (what
#   was measured), where that pick's estimated wave efficiency (`wave_efficiency`) is under
#   FIT_BELOW: counts just past a wave of Triton's tiles, where a whole extra row block and wave
#   cost it 0.5-0.8x of cuBLAS; elsewhere the Triton kernels measured faster.
FIT_MIN_ROWS, FIT_MAX_ROWS = 16, 176
# Consumers of 64 weight rows (fit_gemm.cuh consumer_rows) take up to FIT_WIDE_MAX_ROWS tokens
# (kMaxWideBN): 16-bit and per tensor in the cooperative mode past FIT_MAX_ROWS (tiles of 128 x
# 184..208: at 777 tokens 4 x 200, 3 % padding, where tiles to 176 take 8 x 104, 7 %, for as
# many tiles; cuBLAS runs 128 x 200 there). `fitted_tiles(..., coop_max_rows)` takes them in
# place of a cooperative pick of at most FIT_COOP_MAX_WAVES waves where they cost less in as
# many waves; the pick's bound FIT_COOP_PICK_MAX_ROWS. Measured beside the tiles to 176 (one
# H200, 2026-12-07, docs/results/gemm_fit_wide_1gpu.json; `bench gemm_fused` times the bound
# the pick did not take: `tokenweave_wide` / `_narrow`): 1.023-1.060x faster at all 54 points
# of 777 tokens (Llama-3-8B, Llama-3.3-70B, Qwen2.5-72B, o_proj and fc2, TP 2/4/8; bf16, fp16,
# e4m3 per tensor), 1.003-1.028x at 1531 (Llama-3-8B, where the Triton pick stays).
# e4m3 in blocks a consumer holds two accumulators: of 128 weight rows up to
# FIT_BLOCKS_HALVES_MAX_ROWS tokens, of 64 above it up to FIT_WIDE_MAX_ROWS.
# The pick's extents past FIT_BLOCKS_PICK_MAX_ROWS (64-row consumers) only where their tiles
# take at most FIT_BLOCKS_WIDE_MAX_WAVES waves: past two waves they ran 0.90-1.00x of the
# narrower pick's speed at the median per wave count (docs/kernel.md "Speed, in blocks").
FIT_BLOCKS_HALVES_MAX_ROWS = 104
FIT_WIDE_MAX_ROWS = 208
FIT_BLOCKS_PICK_MAX_ROWS = 104
FIT_BLOCKS_WIDE_MAX_WAVES = 2
# e4m3 in blocks with the tokens as the MMA's M (`fit_tiles(..., tokens_m=True)`, never picked:
# measured at two points only, faster than the pick at one, docs/kernel.md): FIT_TOKENS_M_ROWS
# tokens a consumer (one m64 wgmma; a tile of two consumers' in the cooperative mode), the
# tile's weight rows one of FIT_TOKENS_M_EXTENTS (the instantiations, fit_gemm_host.cuh
# TokensMExtents: each holds a main loop per place of a tile's first weight row in its 128-row
# scale block).
FIT_TOKENS_M_ROWS = 64
FIT_TOKENS_M_EXTENTS = (64, 96, 128, 144, 160, 176, 192, 208)
FIT_TILE_COST = 16
FIT_COOP_MAX_WAVES = 2
FIT_COOP_MIN_ROWS = 96
FIT_COOP_PICK_MAX_ROWS = FIT_WIDE_MAX_ROWS
FIT_BELOW = 0.85
FIT_MIN_CALL = 512
# Over fewer than FIT_SHORT_K in-features (16-bit and per tensor) only where that efficiency is
# under FIT_BELOW_SHORT_K: there a tile's fixed costs (the ring's fill, the epilogue) weigh on
# 7-14 K steps, and the fitted kernel the 0.85 rule gave ran slower than the Triton pick it
# displaced at 22 of 34 such points (the o_proj shards of Qwen2.5-7B at TP 4 and 8, Qwen2.5-32B
# and Llama-3-8B at TP 8, K = 448-896), 21 of them with efficiencies of 0.757-0.848, while
# under 0.74 it was the faster at 10 of 11 (513 / 641 / 777 / 1279 tokens: up to 1.13x; the
# 11th slower by 0.4 %). Keeping the Triton pick at the 23 points of 0.75-0.85, by the rows of
# the same runs: 1.094x at the median there (0.956-1.26x; one H200, bf16, 2026-12-07,
# gemm_fused_1gpu.json: 440 -> 444 points at 0.98x of cuBLAS), 1.059x (one H100, fp16,
# 2026-12-06, gemm_fused_1gpu_fp16.json: 264 -> 269) and 1.072x (one H100, e4m3 per tensor,
# 2026-12-06, gemm_fused_1gpu_fp8.json: 402 -> 410); docs/kernel.md "Short K".
FIT_SHORT_K = 1024
FIT_BELOW_SHORT_K = 0.75
# Between FIT_BELOW and FIT_BELOW_PINGPONG, 16-bit calls over at least FIT_SHORT_K in-features
# with at least FIT_PINGPONG_MIN_TILES ping-pong tiles a CTA (a part-empty second wave or later)
# take the fitted kernel where its tiles take its ping-pong mode, in the replicated layout (the
# sweeps'; sequence parallel keeps its pick until measured): at the sweep's points that is
# 18 shards (Qwen2.5-32B at 3001 and 5003 tokens, Qwen2.5-7B at 5003 and 6143; efficiencies
# 0.888-0.925), where it measured faster than the Triton pick at all 18 on one H200 in bf16
# (1.010-1.064x, median 1.037; gemm_fused_1gpu.json, 2026-12-07) and at all 18 on one H100 in
# fp16 (1.002-1.262x, median 1.067; gemm_fused_1gpu_fp16.json, 2026-12-06); the next
# efficiency up, 0.942 (Qwen2.5-32B at 3583), had it slower at 5 of 6 on the H200
# (docs/kernel.md "Part-empty waves").
FIT_BELOW_PINGPONG = 0.93
FIT_PINGPONG_MIN_TILES = 2
# Under one ping-pong tile a CTA (a call of fewer 128 x 128 tiles than CTAs) the fitted kernel's
# ping-pong mode never takes a call: there it was slower than the Triton pick at every point
# where a rule gave it one (Qwen2.5-7B at 512 tokens, Llama-3-8B's fc2 at 512 in e4m3: 4 of 4
# on one H200 in bf16, 4 of 4 on one H100 in fp16, 6 of 6 on one H100 in e4m3 per tensor;
# 0.83-0.95x; gemm_fused_1gpu.json, _fp16.json, _fp8.json).
FIT_PINGPONG_MIN_CTA_TILES = 1
FIT_FP8_MIN_K = 2048
FP8_PARTIAL_BOX_MIN_K = 4096
# The device matters for 16-bit calls of many tiles: on an H100 (HBM3, 3.35 TB/s) the Triton
# ping-pong kernel fell to 0.87-0.91x of cuBLAS at the median at 10K-16K tokens of long-K
# shards (0.70x at Llama-3.3-70B's fc2 at TP 2) where the fitted kernel's ping-pong mode held
# 0.97-1.0x, while on an H200 (HBM3e, 4.8 TB/s) the Triton kernel was the faster at most such
# points (docs/kernel.md "16-bit on an H100"). On devices whose name holds one of
# FIT_LONG_K_DEVICES (`fits_long_k`), the fitted kernel's ping-pong mode also takes 16-bit
# calls over more than FIT_LONG_K in-features with at least FIT_LONG_MIN_TILES 128 x 128 tiles
# a CTA (one H100's fp16 sweep: faster than the Triton pick at 203 of the 253 points it
# changes, 1.11x at the median).
FIT_LONG_K_DEVICES = ("H100",)
FIT_LONG_K = 1024
FIT_LONG_MIN_TILES = 8
# Split K (`split_k_tiles`, its part wave) before the other rules on those devices: 16-bit
# calls of SPLIT_MIN_ROWS..SPLIT_MAX_ROWS rows over at least SPLIT_MIN_K_STEPS K steps whose
# split tiles fill at least SPLIT_MIN_WAVES whole waves and leave at least SPLIT_MIN_PART tiles
# in the part wave. One H100's bf16 sweep (docs/results/gemm_split_k_1gpu.json, counts 512-5003,
# every dense family): faster than the pick at all 19 points it takes (1.004-1.13x,
# the fc2 shards of 32B / 70B / 72B at TP 2 and 4 and Llama-3-8B's at TP 2 at 2500-5003
# tokens), while at 1000-2047 tokens, with one whole wave, or with a part wave of 24 tiles or
# fewer, split K was as often slower (0.85-1.05x); past 5003 rows it is not measured.
SPLIT_MIN_ROWS, SPLIT_MAX_ROWS = 2500, 5003
SPLIT_MIN_K_STEPS = 100
SPLIT_MIN_WAVES = 2
SPLIT_MIN_PART = 32


def fits_long_k(device_name: str) -> bool:
    """Whether the fitted kernel takes long-K 16-bit calls of many tiles on this device (its name
    as torch.cuda.get_device_name gives it; FIT_LONG_K_DEVICES)."""
    return any(d in device_name for d in FIT_LONG_K_DEVICES)


def row_blocks(layout: Layout, world: int, rows: int, block_rows: int) -> int:
    """Row blocks holding rows of a call (`segments` lays them out): every chunk's rows in
    blocks of their own (sequence parallel); all rows in whole blocks per segment, only the
    last non-empty segment partial (replicated)."""
    per_segment = -(-max(1, rows) // block_rows)
    return world * per_segment if layout is Layout.SEQUENCE_PARALLEL else per_segment


def estimated_time(t: GemmTiles, layout: Layout, world: int, rows: int, hidden: int,
                   ctas: int) -> float:
    """A call's GEMM time in tile-times of area 1 (`segments`'s arguments, on `ctas` persistent
    CTAs): waves of its tiles x tile area / the tiles' efficiency."""
    tiles = row_blocks(layout, world, rows, t.block_rows) * t.col_tiles(hidden)
    return -(-tiles // max(1, ctas)) * t.block_rows * t.block_cols / t.efficiency


def fit_tile_rows(extent: int, cooperative: bool, blocks: bool = False) -> int:
    """Weight rows of a fitted tile (fit_gemm.cuh consumer_rows): 128 a consumer, 64 past
    FIT_MAX_ROWS tokens (in blocks past FIT_BLOCKS_HALVES_MAX_ROWS); both consumers' in the
    cooperative mode."""
    rows = 64 if extent > (FIT_BLOCKS_HALVES_MAX_ROWS if blocks else FIT_MAX_ROWS) else 128
    return 2 * rows if cooperative else rows


def fit_max_rows(cooperative: bool, blocks: bool = False, pair: bool = False) -> int:
    """The largest token extent of a fitted tile (fit_gemm.cuh max_bn): FIT_WIDE_MAX_ROWS with
    64-row consumers, which exist in blocks and in the cooperative mode outside pairs; else
    FIT_MAX_ROWS."""
    return FIT_WIDE_MAX_ROWS if blocks or (cooperative and not pair) else FIT_MAX_ROWS


def fit_pick(layout: Layout, world: int, rows: int, hidden: int, ctas: int,
              cooperative: bool, max_rows: int = FIT_MAX_ROWS,
              blocks: bool = False) -> tuple[int, int]:
    """(waves, token extent) of the fitted kernel's best tiles in one mode (FIT_TILE_COST), of
    token extents up to max_rows (blocks: e4m3 operands in blocks, whose tiles' weight rows
    depend on the extent: a wave's time counts them)."""
    groups = world if layout is Layout.SEQUENCE_PARALLEL else 1

    def waves_cost(extent: int) -> tuple[int, int]:
        tile_rows = fit_tile_rows(extent, cooperative, blocks)
        m_tiles = -(-hidden // tile_rows)
        waves = -(-m_tiles * groups * -(-max(1, rows) // extent) // max(1, ctas))
        return waves, waves * tile_rows * (extent + FIT_TILE_COST)

    extent = min(range(FIT_MIN_ROWS, max_rows + 1, 8), key=lambda e: (waves_cost(e)[1], -e))
    return waves_cost(extent)[0], extent


def fitted_tiles(layout: Layout, world: int, rows: int, hidden: int, ctas: int,
                 coop_max_rows: int = FIT_COOP_PICK_MAX_ROWS) -> GemmTiles:
    """The fitted kernel's tiles of a call (`segments`'s arguments; the FIT_* rules above): a
    cooperative pick to FIT_MAX_ROWS tokens, or one of 64-row consumers to coop_max_rows
    where its waves stay within FIT_COOP_MAX_WAVES, else the ping-pong mode."""
    if not FIT_MAX_ROWS <= coop_max_rows <= FIT_WIDE_MAX_ROWS:
        raise TokenWeaveInputError(f"coop_max_rows must be in {FIT_MAX_ROWS}.."
                                   f"{FIT_WIDE_MAX_ROWS}, got {coop_max_rows}")
    waves, extent = fit_pick(layout, world, rows, hidden, ctas, cooperative=True)
    if waves <= FIT_COOP_MAX_WAVES and extent >= FIT_COOP_MIN_ROWS:
        wide = fit_pick(layout, world, rows, hidden, ctas, True, coop_max_rows)
        return fit_tiles(wide[1] if wide[0] <= FIT_COOP_MAX_WAVES else extent, True)
    return fit_tiles(fit_pick(layout, world, rows, hidden, ctas, cooperative=False)[1], False)


def fit_tiles(extent: int, cooperative: bool, block_k: int = 64,
              blocks: bool = False, tokens_m: bool = False, pair: bool = False,
              split: tuple[int, int] = (0, 0)) -> GemmTiles:
    """The fitted kernel's tiles of a token extent in one mode (block_k: FP8_BLOCK_K for e4m3
    operands; blocks: scaled in blocks, `fit_tile_rows`). tokens_m (e4m3 in blocks): the
    tokens as the MMA's M, `extent` the tiles' weight rows (FIT_TOKENS_M_EXTENTS), their
    tokens FIT_TOKENS_M_ROWS a consumer; a tiles object the kernel takes, never the pick.
    pair (the cooperative mode, 16-bit or e4m3 per tensor): clusters of two CTAs, each a token
    tile of one weight tile whose loads they share (TMA multicast: a third fewer bytes from L2
    a CTA; docs/kernel.md "One tile a CTA under Nsight Compute"); never the pick.
    split (the cooperative mode, 16-bit or e4m3 per tensor, not in pairs): split K, (tiles,
    steps): the K steps of a call's last `tiles` tiles dealt out `steps` a CTA
    (`split_k_tiles`)."""
    if pair and (not cooperative or blocks or tokens_m):
        raise TokenWeaveInputError(
            f"pairs of CTAs take the fitted kernel's cooperative mode, not in blocks: got "
            f"cooperative={cooperative}, blocks={blocks}, tokens_m={tokens_m}")
    if min(split) < 0 or (split[0] > 0) != (split[1] > 0) or (
            split[0] and (not cooperative or blocks or tokens_m or pair)):
        raise TokenWeaveInputError(
            f"split K takes (tiles, steps) both positive or both 0, and the fitted kernel's "
            f"cooperative mode outside pairs and blocks: got split={split}, "
            f"cooperative={cooperative}, blocks={blocks}, tokens_m={tokens_m}, pair={pair}")
    most = fit_max_rows(cooperative, blocks, pair)
    if not tokens_m and not (FIT_MIN_ROWS <= extent <= most and extent % 8 == 0):
        raise TokenWeaveInputError(
            f"the fitted kernel's tiles hold at most {most} tokens here, a multiple of 8 from "
            f"{FIT_MIN_ROWS} (64-row consumers, past {FIT_MAX_ROWS} tokens, take block scales or "
            f"the cooperative mode outside pairs): got extent {extent}, "
            f"cooperative={cooperative}, blocks={blocks}, pair={pair}")
    if tokens_m:
        if not blocks or extent not in FIT_TOKENS_M_EXTENTS:
            raise TokenWeaveInputError(
                f"the tokens as M take e4m3 operands in blocks and weight extents "
                f"{FIT_TOKENS_M_EXTENTS}, got extent {extent}{'' if blocks else ', no blocks'}")
        return GemmTiles(block_rows=FIT_TOKENS_M_ROWS * (2 if cooperative else 1),
                         block_cols=extent, block_k=block_k, stages=0, warps=4, consumers=2,
                         fitted=True, cooperative=cooperative, tokens_m=True)
    return GemmTiles(block_rows=extent, block_cols=fit_tile_rows(extent, cooperative, blocks),
                     block_k=block_k, stages=0, warps=4, consumers=2, fitted=True,
                     cooperative=cooperative, pair=pair, split_tiles=split[0],
                     split_steps=split[1])


# Split K's sums: a tile's fp32 sums a CTA (fit_gemm.cuh split_store), at most this many floats
# (the cooperative tiles' largest weight rows x tokens).
SPLIT_SLOT_FLOATS = max(fit_tile_rows(e, True) * e
                        for e in range(FIT_MIN_ROWS, FIT_WIDE_MAX_ROWS + 1, 8))


# Split K's cost of adding one CTA's sums of a tile, in K steps of the tile (a model's constant:
# `split_k_tiles`).
SPLIT_ADD_STEPS = 3
SPLIT_REGIONS = ("part", "even", "two")


def split_k_tiles(layout: Layout, world: int, rows: int, hidden: int, k: int, ctas: int,
                  block_k: int = 64, region: str = "part",
                  extent: int | None = None) -> GemmTiles | None:
    """Split K's tiles of a call (`segments`'s arguments; block_k: FP8_BLOCK_K for e4m3
    operands), None where every wave of tiles is full: the cooperative tiles of `extent` tokens,
    or (None) of the extent to FIT_WIDE_MAX_ROWS whose tiles cover the call's rows with the
    least area (each tile + FIT_TILE_COST tokens, as `fit_pick` weighs them), the whole waves of
    tiles as without split K, the K steps of the rest dealt out to the CTAs (fit_gemm.cuh
    Work). region "part": the part wave, as many steps a CTA as a model finds fastest (its time
    plus SPLIT_ADD_STEPS for each other CTA's sums of its tiles, at least what spreads them over
    every CTA); "even": the part wave spread over every CTA; "two": the part wave and one whole
    wave (where there is one) spread over every CTA."""
    if region not in SPLIT_REGIONS:
        raise TokenWeaveInputError(f"region must be one of {SPLIT_REGIONS}, got {region!r}")
    def tiles(extent: int) -> int:
        return row_blocks(layout, world, rows, extent) * -(-hidden // fit_tile_rows(extent, True))

    if extent is None:
        extent = min(range(FIT_MIN_ROWS, FIT_WIDE_MAX_ROWS + 1, 8),
                     key=lambda e: (tiles(e) * fit_tile_rows(e, True) * (e + FIT_TILE_COST), -e))
    fit_tiles(extent, True, block_k)  # the extent's checks
    count, k_steps = tiles(extent), -(-k // block_k)
    part = count % max(1, ctas)
    if part == 0:
        return None
    split = part + ctas if region == "two" and count > ctas else part
    steps = -(-split * k_steps // ctas)
    if region == "part":
        steps = max(steps, min(k_steps, math.ceil(math.sqrt(SPLIT_ADD_STEPS * k_steps))))
    return fit_tiles(extent, True, block_k, split=(split, steps))


def _call_rows(layout: Layout, world: int, rows: int) -> int:
    """The GEMM's rows in a call of `rows` rows of every chunk (sequence parallel) or in all."""
    return world * rows if layout is Layout.SEQUENCE_PARALLEL else rows


def wave_efficiency(t: GemmTiles, layout: Layout, world: int, rows: int, hidden: int,
                    ctas: int) -> float:
    """The call's output area over the area its tiles' waves cover at full efficiency
    (`estimated_time`): 1 where the tiles fill every CTA of every wave with rows."""
    area = max(1, _call_rows(layout, world, rows)) * hidden / max(1, ctas)
    return area / estimated_time(t, layout, world, rows, hidden, ctas)


# Every woven layer asks for the same shapes each forward (its halves' row GEMMs); the fitted
# pick's extent searches cost tens of microseconds a call, so a shape's tiles are worked out once
# (a pure function of its arguments; GemmTiles is frozen).
@functools.lru_cache(maxsize=4096)
def tiles_for(layout: Layout, world: int, rows: int, hidden: int, k: int,
              ctas: int, fitted: bool = False, fp8: str | None = None,
              long_k: bool = False) -> GemmTiles:
    """The tiles of a call over k in-features: the ping-pong kernel's where it was measured
    faster (enough tiles per CTA, fewer for short K; in WIDE's place for long K) and its waves
    take no longer than the best one-consumer tiles' (`estimated_time`), else those: large
    where they fill the CTAs, smaller ones where large ones would leave many idle
    (docs/kernel.md, "Tiles"). Why the wave check: at 777 tokens of hidden-5120 shards the
    ping-pong tiles took three waves where WIDE's took two, 0.65-0.90x of cuBLAS against
    0.93-1.09x (one H200, docs/kernel.md "Token counts that are not powers of two").
    fitted: the fitted CUDA kernel can run here (sm_90, the extension built): it takes calls of
    at least FIT_MIN_CALL rows where the Triton pick's wave efficiency is under FIT_BELOW (under
    FIT_BELOW_SHORT_K over fewer than FIT_SHORT_K in-features), and 16-bit calls of part-empty
    waves (`_part_wave_call`: under FIT_BELOW_PINGPONG) where its tiles take its ping-pong mode.
    fp8: e4m3 operands scaled as FP8_SCALINGS names: per tensor the same rules, and the
    fitted kernel also over more than FIT_FP8_MIN_K in-features where its tiles take its
    ping-pong mode; the one-consumer tiles instead over more than FP8_PARTIAL_BOX_MIN_K whose
    rows are not whole 128-byte boxes apart (but where the fitted kernel's wave rule takes the
    call); in blocks `blocks_tiles`; with FP8_BLOCK_K-deep K blocks. long_k: the device is
    one of FIT_LONG_K_DEVICES (`fits_long_k`): 16-bit calls over more than FIT_LONG_K
    in-features with at least FIT_LONG_MIN_TILES ping-pong tiles a CTA take the fitted kernel
    where its tiles take its ping-pong mode; and on those devices split K's part wave takes
    the 16-bit calls of the SPLIT_* rule (`_split_k_call`) before any other rule."""
    if fp8 is not None and fp8 not in FP8_SCALINGS:
        raise TokenWeaveInputError(f"fp8 must be one of {FP8_SCALINGS}, got {fp8!r}")
    if fp8 == "blocks":
        return blocks_tiles(layout, world, rows, hidden, ctas, fitted)
    picked = _triton_tiles(layout, world, rows, hidden, k, ctas)
    # The fitted tiles are worked out only where they may be taken (a per-call host cost).
    may_fit = fitted and _call_rows(layout, world, rows) >= FIT_MIN_CALL
    below = FIT_BELOW if k >= FIT_SHORT_K else FIT_BELOW_SHORT_K
    split = _split_k_call(layout, world, rows, hidden, k, ctas, fp8) if may_fit and long_k else None
    efficiency = wave_efficiency(picked, layout, world, rows, hidden, ctas) if may_fit else 1.0
    if split is not None:
        picked = split
    elif efficiency < below and (
            fit := _fitted_pick(layout, world, rows, hidden, ctas)) is not None:
        picked = fit
    elif fp8 is not None and k > FP8_PARTIAL_BOX_MIN_K and not whole_boxes(k, 1):
        picked = one_consumer_tiles(layout, world, rows, hidden, ctas)
    elif may_fit and (_long_k_call(layout, world, rows, hidden, k, ctas, fp8, long_k)
                      or _part_wave_call(layout, world, rows, hidden, k, ctas, fp8, efficiency)):
        fit = _fitted_pick(layout, world, rows, hidden, ctas)
        picked = fit if fit is not None and not fit.cooperative else picked
    return picked if fp8 is None else replace(picked, block_k=FP8_BLOCK_K)


def blocks_tiles(layout: Layout, world: int, rows: int, hidden: int, ctas: int,
                 fitted: bool) -> GemmTiles:
    """The tiles of a call with e4m3 operands in blocks (`tiles_for`): the fitted kernel's in
    its cooperative mode where it runs (fitted), of token extents up to
    FIT_BLOCKS_PICK_MAX_ROWS, or up to FIT_WIDE_MAX_ROWS where those take at most
    FIT_BLOCKS_WIDE_MAX_WAVES waves and no more than the narrower ones (one or two fuller
    tiles a CTA); else the fastest one-consumer tiles by `estimated_time`. Cooperative: its
    consumers' main loops run at once, so one's scaling of a K block's products runs beside the
    other's MMAs (ping-pong main loops alternate, the tensor cores idle while a consumer
    scales)."""
    if fitted:
        narrow, wide = (fit_pick(layout, world, rows, hidden, ctas, True, most, blocks=True)
                        for most in (FIT_BLOCKS_PICK_MAX_ROWS, FIT_WIDE_MAX_ROWS))
        take_wide = wide[0] <= min(FIT_BLOCKS_WIDE_MAX_WAVES, narrow[0])
        tiles = fit_tiles((wide if take_wide else narrow)[1], True, blocks=True)
    else:
        tiles = one_consumer_tiles(layout, world, rows, hidden, ctas)
    return replace(tiles, block_k=FP8_BLOCK_K)


def one_consumer_tiles(layout: Layout, world: int, rows: int, hidden: int,
                       ctas: int) -> GemmTiles:
    """The one-consumer kernel's tiles of a call with the fewest estimated tile-times."""
    return min(ONE_CONSUMER, key=lambda t: estimated_time(t, layout, world, rows, hidden, ctas))


def _triton_tiles(layout: Layout, world: int, rows: int, hidden: int, k: int,
                  ctas: int) -> GemmTiles:
    """The Triton kernels' tiles of a call (`tiles_for`)."""
    one = one_consumer_tiles(layout, world, rows, hidden, ctas)
    if (estimated_time(PINGPONG, layout, world, rows, hidden, ctas)
            > estimated_time(one, layout, world, rows, hidden, ctas)):
        return one
    per_cta = _pingpong_tiles_per_cta(layout, world, rows, hidden, ctas)
    if per_cta >= (PINGPONG_MIN_TILES_SHORT_K if k <= PINGPONG_MAX_K else PINGPONG_MIN_TILES):
        return PINGPONG
    # WIDE's 64 x 256 tiles against as many 128 x 128 ping-pong ones, which load a fifth fewer
    # operand bytes each: on long K the ping-pong kernel measured faster (docs/kernel.md).
    return PINGPONG if one is WIDE and k > PINGPONG_MAX_K else one


def _fitted_pick(layout: Layout, world: int, rows: int, hidden: int,
                 ctas: int) -> GemmTiles | None:
    """The fitted tiles of a call where they may be its pick (`tiles_for`), else None:
    cooperative ones always, ping-pong ones from FIT_PINGPONG_MIN_CTA_TILES ping-pong tiles a
    CTA."""
    fit = fitted_tiles(layout, world, rows, hidden, ctas)
    few = _pingpong_tiles_per_cta(layout, world, rows, hidden, ctas) < FIT_PINGPONG_MIN_CTA_TILES
    return None if few and not fit.cooperative else fit


def _part_wave_call(layout: Layout, world: int, rows: int, hidden: int, k: int, ctas: int,
                    fp8: str | None, efficiency: float) -> bool:
    """Whether a call is one whose Triton pick's waves are part-empty enough for the fitted
    kernel's ping-pong mode (`tiles_for`): that pick's wave efficiency under
    FIT_BELOW_PINGPONG, 16-bit operands over at least FIT_SHORT_K in-features, at least
    FIT_PINGPONG_MIN_TILES ping-pong tiles a CTA; the replicated layout (the one measured)."""
    return (efficiency < FIT_BELOW_PINGPONG and layout is Layout.REPLICATED and fp8 is None
            and k >= FIT_SHORT_K
            and _pingpong_tiles_per_cta(layout, world, rows, hidden, ctas)
            >= FIT_PINGPONG_MIN_TILES)


def _long_k_call(layout: Layout, world: int, rows: int, hidden: int, k: int, ctas: int,
                 fp8: str | None, long_k: bool) -> bool:
    """Whether a call is long-K enough for the fitted kernel's ping-pong mode (`tiles_for`):
    e4m3 operands over more than FIT_FP8_MIN_K in-features; 16-bit ones, on a device of
    FIT_LONG_K_DEVICES (long_k), over more than FIT_LONG_K with at least FIT_LONG_MIN_TILES
    ping-pong tiles a CTA."""
    if fp8 is not None:
        return k > FIT_FP8_MIN_K
    return (long_k and k > FIT_LONG_K and _pingpong_tiles_per_cta(layout, world, rows, hidden,
                                                                   ctas) >= FIT_LONG_MIN_TILES)


def _split_k_call(layout: Layout, world: int, rows: int, hidden: int, k: int, ctas: int,
                  fp8: str | None) -> GemmTiles | None:
    """Split K's tiles where a call on a long-K device takes them (`tiles_for`; the SPLIT_*
    rule above), else None."""
    call = _call_rows(layout, world, rows)
    if fp8 is not None or not SPLIT_MIN_ROWS <= call <= SPLIT_MAX_ROWS:
        return None
    t = split_k_tiles(layout, world, rows, hidden, k, ctas)
    if t is None or -(-k // t.block_k) < SPLIT_MIN_K_STEPS or t.split_tiles < SPLIT_MIN_PART:
        return None
    tiles = row_blocks(layout, world, rows, t.block_rows) * t.col_tiles(hidden)
    return t if tiles // max(1, ctas) >= SPLIT_MIN_WAVES else None


def _pingpong_tiles_per_cta(layout: Layout, world: int, rows: int, hidden: int,
                            ctas: int) -> float:
    """The ping-pong kernel's 128 x 128 tiles of a call per CTA."""
    return (row_blocks(layout, world, rows, PINGPONG.block_rows) * PINGPONG.col_tiles(hidden)
            / max(1, ctas))


def release_for(t: GemmTiles, tiles: int, ctas: int) -> str:
    """Who publishes a call of `tiles` tiles of shape t on `ctas` persistent CTAs (RELEASES):
    the consumer where each CTA has at most CONSUMER_RELEASE_MAX_WORK LARGE tiles' worth of
    work, else the GEMM."""
    area = t.block_rows * t.block_cols / (LARGE.block_rows * LARGE.block_cols)
    return "consumer" if tiles * area / max(1, ctas) <= CONSUMER_RELEASE_MAX_WORK else "gemm"


@dataclass(frozen=True)
class Segments:
    """One call's segments. Segment c holds input rows first + c * step + j for
    j < length(c) (rows of x viewed as [chunks * chunk_rows, K]) and goes to inbox rows
    row0 + j of rank c's slots."""

    first: int
    step: int
    rows: int
    total: int
    row0: int
    tiles: GemmTiles
    release: str = "gemm"  # who publishes the tiles: RELEASES
    sequence_parallel: bool = False

    def length(self, c: int) -> int:
        """Rows of segment c (the last ones of a replicated call may be short or empty)."""
        return max(0, min(self.rows, self.total - c * self.rows))

    def blocks(self) -> int:
        """Row blocks of a full segment (flags per source and column tile)."""
        return -(-self.rows // self.tiles.block_rows)

    def geometry(self, set_index: int, hidden: int) -> list[int]:
        """The consumer's view of the call (csrc/ops.cu SegmentGeometry): inbox set, its first
        inbox row, rows of a segment, the GEMM's block rows and column tiles (where the consumer
        publishes: the segment as one block of one tile, its one flag per source), and whether
        the consumer publishes the tiles."""
        if self.release == "consumer":
            return [set_index, self.row0, self.rows, self.rows, 1, 1]
        return [set_index, self.row0, self.rows, self.tiles.block_rows,
                self.tiles.col_tiles(hidden), 0]

    def fitted_geometry(self, slots_off: int, rank: int, slot_rows: int, world: int) -> list[int]:
        """The fitted kernel's view of the call (csrc/ops.cu fit_gemm): where rank `rank`'s rows
        go in the owners' inboxes, the token groups (sequence parallel: a segment each;
        replicated: all rows, owner = row / rows), the tiles, the first token tile, the
        one holding segment rank + 1's first row (each rank stores to a different owner
        first), with the tokens as M the tiles' weight rows (else 0), and split K's tiles and
        their K steps a CTA (else 0 and 0)."""
        t = self.tiles
        groups, group_rows = (world, self.rows) if self.sequence_parallel else (1, self.total)
        group_tiles = -(-group_rows // t.block_rows)
        nxt = (rank + 1) % world
        start = nxt * group_tiles if self.sequence_parallel else nxt * self.rows // t.block_rows
        return [slots_off, rank, slot_rows, self.row0, self.first, self.step, groups, group_rows,
                self.rows, t.block_rows, 2 if t.pair else int(t.cooperative), start,
                t.block_cols if t.tokens_m else 0, t.split_tiles, t.split_steps]

    def tile_count(self, world: int, hidden: int) -> int:
        """The fitted kernel's tiles of the call (fit_gemm's p.tiles, outside pairs)."""
        t = self.tiles
        groups, group_rows = (world, self.rows) if self.sequence_parallel else (1, self.total)
        return -(-hidden // t.block_cols) * groups * -(-group_rows // t.block_rows)

    def split_ctas(self, k: int) -> int:
        """The CTAs split K's tiles take (fit_gemm_host.cuh split_ctas; `split_k_tiles`): the
        split tiles' K steps, tiles.split_steps a CTA (0 without split K)."""
        t = self.tiles
        return -(-t.split_tiles * -(-k // t.block_k) // t.split_steps) if t.split_tiles else 0

    def input_rows(self, world: int) -> int:
        """Rows of x the call reads: up to the last segment's last row."""
        return max((self.first + c * self.step + self.length(c) for c in range(world)
                    if self.length(c)), default=0)

    def nonempty_blocks(self, world: int) -> int:
        """Row blocks holding rows, all segments together: segment c's are c * blocks() ...
        (every segment but the last non-empty one is full)."""
        bm = self.tiles.block_rows
        return sum(-(-self.length(c) // bm) for c in range(world))


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def segments(layout: Layout, world: int, rows: int, *, hidden: int, k: int, ctas: int,
             first: int = 0, chunk_stride: int = 0, chunk_row0: int = 0, set_index: int = 0,
             first_set_rows: int = 0, tiles: GemmTiles | None = None,
             release: str | None = None, fitted: bool = False,
             fp8: str | None = None, long_k: bool = False) -> Segments:
    """The segments of a call over `rows` rows of every chunk (sequence parallel) or of all
    rows (replicated), for a hidden-wide output of k in-features computed on `ctas` persistent
    CTAs (which pick the tiles: `tiles_for`).

    first / chunk_stride: where the call's rows are in the GEMM's input x [chunks * n, K]: rows
        first + c * chunk_stride + j of chunk c (sequence parallel; replicated: first + j).
    chunk_row0: sequence parallel: the call's first row within a chunk (the woven half's
        offset); its rows keep that row index in the inbox, so the halves never overlap.
    set_index / first_set_rows: replicated: the woven schedule's half B (set 1) is stored after
        the rows half A's segments (first_set_rows: half A's row count) may take.
    tiles / release: these tiles / this publisher (RELEASES) instead of `tiles_for`'s /
        `release_for`'s pick (benchmarks comparing them, tests reaching both).
    fitted: the fitted kernel may take the call (`tiles_for`) unless the GEMM's release is
        forced; its rows always have the consumer's release.
    fp8: the GEMM's operands are e4m3, scaled as FP8_SCALINGS names (`tiles_for`).
    long_k: the device's rule for long-K calls of many tiles (`tiles_for`, `fits_long_k`).
    """
    if release is not None and release not in RELEASES:
        raise TokenWeaveInputError(f"release must be one of {RELEASES}, got {release!r}")
    # A forced GEMM release keeps the Triton kernels (the fitted one cannot release its rows).
    tiles = tiles or tiles_for(layout, world, rows, hidden, k, ctas,
                               fitted and release != "gemm", fp8, long_k)
    if tiles.fitted and release == "gemm":
        raise TokenWeaveInputError("the fitted kernel's rows are released by its consumer only")
    release = release or ("consumer" if tiles.fitted else release_for(
        tiles, row_blocks(layout, world, rows, tiles.block_rows) * tiles.col_tiles(hidden), ctas))
    if layout is Layout.SEQUENCE_PARALLEL:
        return Segments(first=first, step=chunk_stride, rows=rows, total=world * rows,
                        row0=chunk_row0, tiles=tiles, release=release, sequence_parallel=True)
    # Replicated: the Triton kernels' tiles have one owner each (segments of whole row blocks);
    # the fitted kernel finds each row's owner, so its segments are as even as can be.
    size = max(1, -(-rows // world))
    if not tiles.fitted:
        size = _round_up(size, tiles.block_rows)
    row0 = _round_up(max(1, -(-first_set_rows // world)), MAX_BLOCK_ROWS) if set_index else 0
    return Segments(first=first, step=size, rows=size, total=rows, row0=row0, tiles=tiles,
                    release=release)


def half_segments(layout: Layout, world: int, halves: tuple, i: int, *, hidden: int, k: int,
                  ctas: int, first: int = 0, chunk_stride: int = 0,
                  tiles: GemmTiles | None = None, release: str | None = None,
                  fitted: bool = False, fp8: str | None = None,
                  long_k: bool = False) -> Segments:
    """The segments of the woven schedule's half i (`halves`: schedule.Half of every chunk, one
    or two), inbox set i; the GEMM reads its rows at `first` of every chunk of x, chunks
    `chunk_stride` rows apart (`segments` says how, and what `tiles`, `release`, `fitted`,
    `fp8` and `long_k` do)."""
    return segments(layout, world, halves[i].rows, hidden=hidden, k=k, ctas=ctas, first=first,
                    chunk_stride=chunk_stride, chunk_row0=halves[i].offset, set_index=i,
                    first_set_rows=halves[0].rows, tiles=tiles, release=release, fitted=fitted,
                    fp8=fp8, long_k=long_k)


def slot_rows(max_tokens: int, world: int) -> int:
    """Inbox rows per source slot that hold any call of up to max_tokens rows in both sets:
    sequence parallel, one chunk (max_tokens / world); replicated, two halves' segments, each
    rounded up to whole blocks."""
    return -(-max_tokens // world) + 2 * MAX_BLOCK_ROWS
