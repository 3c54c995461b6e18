"""The GEMM-fused mechanism on CPU: its geometry (ops/segments.py), the emulation of its data
movement against the pure-PyTorch reference (gloo ranks at TP 2, 4 and 8), and its bad input.

Geometry: for both layouts, TP 2/4/8, row counts around the tile sizes and output widths / CTA
counts that between them take every tile shape, every input row of a call goes to exactly one
owner, each woven half keeps inbox rows of its own (sets 0 and 1 never overlap), every call of
up to max_tokens rows fits a slot and its flag blocks; the tiles are the ones with the fewest
estimated tile-times, counted on the segments' real row blocks. Emulation: the
communicating GEMM + its consumer (`row_gemm` + `allreduce_rmsnorm(comm="gemm")`) equal
x @ W^T summed over ranks (+ bias once) + residual, normed, computed by the reference op, for a
whole call and for split halves; outputs poisoned first.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from _dist import run_ranks

from megatron_tokenweave.bench.gemm_pair import even_halves
from megatron_tokenweave.communicator import Communicator, WorkspaceCapacityError
from megatron_tokenweave.ops import Layout, TokenWeaveInputError, fused_allreduce_rmsnorm_reference
from megatron_tokenweave.ops.segments import (
    FIT_BELOW,
    FIT_BELOW_SHORT_K,
    FIT_COOP_MAX_WAVES,
    FIT_COOP_MIN_ROWS,
    FIT_COOP_PICK_MAX_ROWS,
    FIT_LONG_K,
    FIT_LONG_MIN_TILES,
    FIT_MAX_ROWS,
    FIT_MIN_CALL,
    FIT_MIN_ROWS,
    FIT_SHORT_K,
    FIT_TILE_COST,
    FIT_WIDE_MAX_ROWS,
    FP8_BLOCK_K,
    LARGE,
    MIN_BLOCK_ROWS,
    PINGPONG,
    PINGPONG_MAX_K,
    PINGPONG_MIN_TILES,
    PINGPONG_MIN_TILES_SHORT_K,
    RELEASES,
    SMALL,
    SPLIT_ADD_STEPS,
    SPLIT_MAX_ROWS,
    SPLIT_MIN_K_STEPS,
    SPLIT_MIN_PART,
    SPLIT_MIN_ROWS,
    SPLIT_MIN_WAVES,
    SPLIT_REGIONS,
    TILES,
    WIDE,
    estimated_time,
    fit_tiles,
    fits_long_k,
    fitted_tiles,
    half_segments,
    release_for,
    row_blocks,
    segments,
    slot_rows,
    split_k_tiles,
    tiles_for,
    wave_efficiency,
)
from megatron_tokenweave.schedule import Half

ROWS = (1, 2, 7, 63, 64, 65, 127, 128, 129, 1000, 1031, 4096)
LAYOUTS = (Layout.SEQUENCE_PARALLEL, Layout.REPLICATED)
EPS = 1e-5
# (hidden, persistent CTAs): between them, every tile shape is taken for some row counts
# (hidden, in-features, persistent CTAs): between them, every tile shape is taken for some rows
OUTPUTS = ((4096, 1024, 132), (8192, 3584, 116), (5120, 3584, 8))


def _calls(layout: Layout, world: int, n: int, split: bool, hidden: int = 4096, k: int = 1024,
           ctas: int = 132, fitted: bool = False):
    """(half, segments) of each call of one woven forward with n rows a chunk (fitted: the
    fitted kernel's tiles forced)."""
    halves = even_halves(n, split)
    return [(h, half_segments(layout, world, halves, i, hidden=hidden, k=k, ctas=ctas,
                              first=h.offset, chunk_stride=n,
                              tiles=fitted_tiles(layout, world, h.rows, hidden, ctas)
                              if fitted else None))
            for i, h in enumerate(halves)]


@pytest.mark.parametrize("layout,world", list(itertools.product(LAYOUTS, (2, 4, 8))))
def test_segments_cover_every_row_once_and_halves_never_share_inbox_rows(layout, world):
    chunks = world if layout is Layout.SEQUENCE_PARALLEL else 1
    for n, split, out, fitted in itertools.product(ROWS, (False, True), OUTPUTS, (False, True)):
        calls = _calls(layout, world, n, split, *out, fitted=fitted)
        covered: list[int] = []
        spans = []
        for half, seg in calls:
            for c in range(world):
                start = seg.first + c * seg.step
                covered += range(start, start + seg.length(c))
            if layout is Layout.SEQUENCE_PARALLEL:
                assert all(seg.length(c) == half.rows for c in range(world))
            else:
                # whole row blocks per owner for the Triton kernels, as even as can be for the
                # fitted one (it finds each row's owner)
                want = -(-half.rows // world)
                assert (seg.rows == want if fitted else seg.rows % seg.tiles.block_rows == 0)
                assert sum(seg.length(c) for c in range(world)) == half.rows
            spans.append(set(range(seg.row0, seg.row0 + seg.rows)))
        want = sorted(c * n + r for c in range(chunks) for half, _ in calls
                      for r in range(half.offset, half.offset + half.rows))
        assert sorted(covered) == want, (n, split, out)
        if len(spans) == 2:
            assert not spans[0] & spans[1], (n, split, out)


@pytest.mark.parametrize("layout,world", list(itertools.product(LAYOUTS, (2, 4, 8))))
def test_every_call_up_to_max_tokens_fits_a_slot_and_its_flags(layout, world):
    max_tokens = 4096
    capacity = slot_rows(max_tokens, world)
    blocks = -(-capacity // MIN_BLOCK_ROWS)
    sp = layout is Layout.SEQUENCE_PARALLEL
    for tokens in range(world if sp else 1, max_tokens + 1, 37 * world if sp else 37):
        n = tokens // world if sp else tokens
        for split, out, fitted in itertools.product((False, True), OUTPUTS, (False, True)):
            for i, (_, seg) in enumerate(_calls(layout, world, n, split, *out, fitted=fitted)):
                assert seg.row0 + seg.rows <= capacity, (tokens, split, seg)
                _, _, rows, block_rows, col_tiles, _ = seg.geometry(i, out[0])
                assert -(-rows // block_rows) * block_rows // MIN_BLOCK_ROWS <= blocks
                assert col_tiles <= -(-out[0] // 128)


@pytest.mark.parametrize("layout,world", list(itertools.product(LAYOUTS, (2, 4, 8))))
def test_nonempty_blocks_are_the_first_ones_in_owner_order(layout, world):
    """The GEMM enumerates row blocks 0 .. nonempty_blocks() - 1 as (owner, block) =
    divmod(g, blocks()): those are exactly the blocks that hold rows."""
    for n, out in itertools.product(ROWS, OUTPUTS):
        for _, seg in _calls(layout, world, n, True, *out):
            bm, blocks = seg.tiles.block_rows, seg.blocks()
            holding = [(c, m) for c in range(world) for m in range(blocks)
                       if m * bm < seg.length(c)]
            assert holding == [divmod(g, blocks) for g in range(seg.nonempty_blocks(world))]


@pytest.mark.parametrize("layout,world", list(itertools.product(LAYOUTS, (2, 4, 8))))
@pytest.mark.parametrize("hidden,k,ctas", OUTPUTS)
def test_tiles_are_pingpong_by_its_rule_else_the_fewest_estimated_tile_times(layout, world,
                                                                            hidden, k, ctas):
    """The ping-pong kernel where its waves take no longer than the best one-consumer tiles'
    and either its tiles per CTA reach the threshold of the call's K or the least estimate is
    WIDE's and K is long; else the one-consumer candidate with the least estimate, counting
    the tiles the segments really have (row_blocks against nonempty_blocks)."""
    for rows in range(1, 4097, 7):
        seg = segments(layout, world, rows, hidden=hidden, k=k, ctas=ctas)
        got = seg.tiles
        assert seg.nonempty_blocks(world) == row_blocks(layout, world, rows, got.block_rows)
        per_cta = row_blocks(layout, world, rows, 128) * PINGPONG.col_tiles(hidden) / ctas
        need = PINGPONG_MIN_TILES_SHORT_K if k <= PINGPONG_MAX_K else PINGPONG_MIN_TILES
        times = {t: estimated_time(t, layout, world, rows, hidden, ctas)
                 for t in (LARGE, WIDE, SMALL)}
        least = min(times, key=times.get)
        in_wides_place = least is WIDE and k > PINGPONG_MAX_K
        no_slower = estimated_time(PINGPONG, layout, world, rows, hidden, ctas) <= times[least]
        assert (got is PINGPONG) == (no_slower and (per_cta >= need or in_wides_place)), rows
        if got is not PINGPONG:
            assert times[got] == min(times.values()), rows


def test_outputs_take_every_tile_shape():
    """The geometry tests' outputs reach every kernel and tile shape."""
    seen = {segments(layout, world, rows, hidden=hidden, k=k, ctas=ctas).tiles
            for layout, world, (hidden, k, ctas), rows in itertools.product(
                LAYOUTS, (2, 4, 8), OUTPUTS, ROWS)}
    assert seen == {LARGE, WIDE, SMALL, PINGPONG}


def test_tiles_of_the_measured_shapes():
    """The cases the one-GPU benchmark settled (docs/kernel.md), replicated on 132 SMs.
    One consumer: Llama-3-8B at 512 tokens takes 64 x 256 tiles (128 x 256 would leave half
    the SMs idle), at 1024 and long K the large ones; Llama-70B at 512 tokens and TP 8 keeps the
    large ones (four owners of 128 rows); a decode-sized call the small ones. Ping-pong: from 3
    tiles per CTA, and from 2 (1024 tokens of Llama-3-8B) for short K; in WIDE's place for long
    K (Llama-3-8B's fc2 at 512 tokens and TP 2 or 4). Not where its waves outlast WIDE's
    (Qwen2.5-32B's o_proj at 777 tokens)."""
    rep = Layout.REPLICATED
    assert tiles_for(rep, 2, 512, 4096, 2048, 132) is WIDE
    assert tiles_for(rep, 4, 512, 4096, 1024, 132) is WIDE
    assert tiles_for(rep, 8, 512, 4096, 1792, 132) is WIDE
    assert tiles_for(rep, 2, 512, 4096, 7168, 132) is PINGPONG  # one tile per CTA, long K
    assert tiles_for(rep, 4, 512, 4096, 3584, 132) is PINGPONG
    assert tiles_for(rep, 2, 1024, 4096, 7168, 132) is LARGE  # 1.9 tiles per CTA, long K
    assert tiles_for(rep, 2, 512, 8192, 4096, 132) is LARGE
    assert tiles_for(rep, 2, 4, 4096, 2048, 132) is SMALL
    assert tiles_for(rep, 8, 1024, 4096, 512, 132) is PINGPONG  # 1.9 tiles per CTA, short K
    assert tiles_for(rep, 8, 512, 8192, 1024, 132) is PINGPONG
    assert tiles_for(rep, 8, 2048, 4096, 1792, 132) is PINGPONG
    assert tiles_for(rep, 4, 2048, 4096, 3584, 132) is PINGPONG  # 3.9 tiles per CTA
    assert tiles_for(rep, 2, 1024, 8192, 14336, 132) is PINGPONG
    assert tiles_for(rep, 2, 777, 5120, 2560, 132) is WIDE


@pytest.mark.parametrize("layout", LAYOUTS)
def test_forced_tiles_replace_the_pick(layout):
    """A benchmark's forced tiles reach the segments, and the replicated segment rows follow
    their block rows (whole blocks per owner)."""
    halves = (Half(0, 300), Half(300, 301))
    for tiles in TILES.values():
        for i in range(2):
            seg = half_segments(layout, 4, halves, i, hidden=4096, k=1024, ctas=132, tiles=tiles)
            assert seg.tiles is tiles
            if layout is Layout.REPLICATED:
                assert seg.rows % tiles.block_rows == 0 and seg.rows * 4 >= halves[i].rows


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", (2, 4, 8))
def test_release_is_the_consumers_up_to_two_large_tiles_per_cta(layout, world):
    """The consumer publishes the tiles where the GEMM's CTAs have at most two LARGE tiles'
    worth of work (the tiles the segments really hold, whatever their shape), else the GEMM."""
    seen = set()
    for rows, (hidden, k, ctas) in itertools.product(ROWS, OUTPUTS):
        seg = segments(layout, world, rows, hidden=hidden, k=k, ctas=ctas)
        t = seg.tiles
        work = (seg.nonempty_blocks(world) * t.col_tiles(hidden) * t.block_rows * t.block_cols
                / (LARGE.block_rows * LARGE.block_cols * ctas))
        assert seg.release == ("consumer" if work <= 2 else "gemm"), (rows, hidden, ctas, work)
        seen.add(seg.release)
    assert seen == set(RELEASES)


def test_release_of_the_measured_shapes():
    """512-2K tokens of the Llama-3-8B shards (up to two LARGE tiles' worth per CTA, where the
    GEMM's release measured up to 9 %) and 1K of the 70B ones: the consumer; 4K of the 8B
    ones and 2K-4K of the 70B ones: the GEMM."""
    rep = Layout.REPLICATED
    for world, k in ((2, 2048), (2, 7168), (8, 512), (8, 1792)):
        for tokens in (512, 1024, 2048):
            release = segments(rep, world, tokens, hidden=4096, k=k, ctas=132).release
            assert release == "consumer", (world, k, tokens)
        assert segments(rep, world, 4096, hidden=4096, k=k, ctas=132).release == "gemm"
    for world, k in ((2, 4096), (8, 1024)):
        assert segments(rep, world, 1024, hidden=8192, k=k, ctas=132).release == "consumer"
        for tokens in (2048, 4096):
            assert segments(rep, world, tokens, hidden=8192, k=k, ctas=132).release == "gemm"
    assert release_for(LARGE, 264, 132) == "consumer"
    assert release_for(LARGE, 265, 132) == "gemm"
    assert release_for(PINGPONG, 528, 132) == "consumer"  # 128 x 128: half a LARGE tile


@pytest.mark.parametrize("layout", LAYOUTS)
def test_forced_release_replaces_the_pick(layout):
    """A forced release reaches the segments; anything but RELEASES is refused."""
    halves = (Half(0, 3000), Half(3000, 3001))
    for release in RELEASES:
        for i in range(2):
            seg = half_segments(layout, 2, halves, i, hidden=4096, k=1024, ctas=132,
                                release=release)
            assert seg.release == release
    with pytest.raises(TokenWeaveInputError, match="release must be one of"):
        segments(layout, 2, 100, hidden=4096, k=1024, ctas=132, release="cta")


FIT_LAYOUT_CASES = list(itertools.product(LAYOUTS, (2, 4, 8),
                                          ((8192, 132), (4096, 132), (5120, 116), (3584, 8))))


@pytest.mark.parametrize("layout,world,shape", FIT_LAYOUT_CASES)
def test_fitted_tiles_fit_the_call(layout, world, shape):
    """The fitted kernel's token extent: a multiple of 8 with the fewest waves x weight rows x
    (extent + FIT_TILE_COST), the largest on ties; cooperative (both consumers on one tile)
    exactly where that mode's pick to FIT_MAX_ROWS (256 weight rows) takes at most
    FIT_COOP_MAX_WAVES waves of at least FIT_COOP_MIN_ROWS tokens, and then of 64-row
    consumers (128 weight rows, FIT_MAX_ROWS..FIT_WIDE_MAX_ROWS tokens) where those cost
    less within as many waves (coop_max_rows; the pick's bound FIT_COOP_PICK_MAX_ROWS); else
    ping-pong tiles of 128 weight rows to FIT_MAX_ROWS."""
    hidden, ctas = shape
    groups = world if layout is Layout.SEQUENCE_PARALLEL else 1

    def best(cooperative, rows, most=FIT_MAX_ROWS):
        def waves(e):
            m = -(-hidden // ((256 if e <= FIT_MAX_ROWS else 128) if cooperative else 128))
            return -(-m * groups * -(-rows // e) // ctas)

        def cost(e):
            return waves(e) * (256 if cooperative and e <= FIT_MAX_ROWS else 128) * (
                e + FIT_TILE_COST)

        extent = min(range(FIT_MIN_ROWS, most + 1, 8), key=lambda e: (cost(e), -e))
        return waves(extent), extent

    for rows, most in itertools.product(
            (1, 7, 100, 512, 513, 641, 777, 1279, 1531, 4099, 5003, 16383),
            (FIT_MAX_ROWS, FIT_WIDE_MAX_ROWS)):
        t = fitted_tiles(layout, world, rows, hidden, ctas, most)
        if most == FIT_COOP_PICK_MAX_ROWS:
            assert t == fitted_tiles(layout, world, rows, hidden, ctas)
        waves, extent = best(True, rows)
        cooperative = waves <= FIT_COOP_MAX_WAVES and extent >= FIT_COOP_MIN_ROWS
        if cooperative:
            wide = best(True, rows, most)
            extent = wide[1] if wide[0] <= FIT_COOP_MAX_WAVES else extent
        else:
            extent = best(False, rows)[1]
        assert t.fitted and t.cooperative == cooperative and t.block_rows == extent, rows
        assert t.block_rows % 8 == 0 and FIT_MIN_ROWS <= t.block_rows <= (
            most if cooperative else FIT_MAX_ROWS)
        rows_a_consumer = 64 if t.block_rows > FIT_MAX_ROWS else 128
        assert t.block_cols == (2 if cooperative else 1) * rows_a_consumer and t.consumers == 2


@pytest.mark.parametrize("layout,world,shape", FIT_LAYOUT_CASES)
def test_fitted_kernel_takes_calls_where_the_triton_tiles_waste_waves(layout, world, shape):
    """Where the fitted kernel runs (`fitted`), it takes the calls of at least FIT_MIN_CALL rows
    whose Triton pick covers the call's area at under FIT_BELOW of its waves (under
    FIT_BELOW_SHORT_K over fewer than FIT_SHORT_K in-features), and in its ping-pong mode the
    part-empty waves of `_part_wave_call`, its ping-pong tiles never under
    FIT_PINGPONG_MIN_CTA_TILES ping-pong tiles a CTA; elsewhere, and wherever it does not run,
    the Triton pick stands."""
    from megatron_tokenweave.ops.segments import (
        FIT_PINGPONG_MIN_CTA_TILES,
        _part_wave_call,
        _pingpong_tiles_per_cta,
    )

    hidden, ctas = shape
    for k, rows in itertools.product((FIT_SHORT_K - 128, FIT_SHORT_K, 4096), range(1, 5000, 37)):
        triton = tiles_for(layout, world, rows, hidden, k, ctas)
        assert not triton.fitted
        total = world * rows if layout is Layout.SEQUENCE_PARALLEL else rows
        below = FIT_BELOW if k >= FIT_SHORT_K else FIT_BELOW_SHORT_K
        eff = wave_efficiency(triton, layout, world, rows, hidden, ctas)
        fit = fitted_tiles(layout, world, rows, hidden, ctas)
        may = fit.cooperative or _pingpong_tiles_per_cta(
            layout, world, rows, hidden, ctas) >= FIT_PINGPONG_MIN_CTA_TILES
        takes = total >= FIT_MIN_CALL and may and (eff < below or not fit.cooperative and (
            _part_wave_call(layout, world, rows, hidden, k, ctas, None, eff)))
        got = tiles_for(layout, world, rows, hidden, k, ctas, fitted=True)
        assert got == (fit if takes else triton), (k, rows)


def test_fitted_kernel_of_the_measured_shapes():
    """Counts just past a wave of the Triton tiles take the fitted kernel (Llama-3.3-70B's
    o_proj at 513 and 777 tokens, TP 2 and 8; Llama-3-8B's at 513); the powers of two keep the
    Triton kernels (docs/kernel.md, "The fitted kernel")."""
    rep = Layout.REPLICATED
    for world, k in ((2, 4096), (8, 1024)):
        for tokens in (513, 777):
            assert tiles_for(rep, world, tokens, 8192, k, 132, fitted=True).fitted, tokens
        for tokens in (512, 1024, 2048, 4096, 8192):
            assert not tiles_for(rep, world, tokens, 8192, k, 132, fitted=True).fitted, tokens
    assert tiles_for(rep, 2, 513, 4096, 2048, 132, fitted=True).fitted
    t = tiles_for(rep, 2, 513, 8192, 4096, 132, fitted=True)
    # 4 x 136 tokens by 32 x 256 weight rows: one wave of 128 cooperative tiles
    assert (t.block_rows, t.cooperative) == (136, True)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_long_k_rule_of_the_device(layout):
    """On a device of FIT_LONG_K_DEVICES (long_k), a 16-bit call over more than FIT_LONG_K
    in-features with at least FIT_LONG_MIN_TILES ping-pong tiles a CTA takes the fitted kernel
    where its tiles are in ping-pong mode, and a 16-bit call of the SPLIT_* rule takes split
    K's part wave (`split_k_tiles`) before that; every other call keeps the pick it has without
    the rules, and without long_k (or without the fitted kernel, or with e4m3 operands, which
    have their own long-K rule) nothing changes."""
    world, hidden, ctas = 2, 8192, 132
    groups = world if layout is Layout.SEQUENCE_PARALLEL else 1
    changed = split_calls = 0
    for k, rows in itertools.product((512, 1024, 1025, 3584, 14336), range(512, 17000, 499)):
        base = tiles_for(layout, world, rows, hidden, k, ctas, fitted=True)
        got = tiles_for(layout, world, rows, hidden, k, ctas, fitted=True, long_k=True)
        per_cta = row_blocks(layout, world, rows, 128) * (hidden // 128) / ctas
        fit = fitted_tiles(layout, world, rows, hidden, ctas)
        rule = k > FIT_LONG_K and per_cta >= FIT_LONG_MIN_TILES and not fit.cooperative
        split = split_k_tiles(layout, world, rows, hidden, k, ctas)
        takes_split = (split is not None and SPLIT_MIN_ROWS <= groups * rows <= SPLIT_MAX_ROWS
                       and -(-k // 64) >= SPLIT_MIN_K_STEPS and split.split_tiles >= SPLIT_MIN_PART
                       and split.col_tiles(hidden) * groups * -(-rows // split.block_rows)
                       // ctas >= SPLIT_MIN_WAVES)
        split_calls += takes_split
        assert got == (split if takes_split else fit if rule and not base.fitted else base), (
            k, rows)
        changed += got != base
        assert tiles_for(layout, world, rows, hidden, k, ctas, long_k=True) == tiles_for(
            layout, world, rows, hidden, k, ctas), (k, rows)
        for scaling in ("tensor", "blocks"):
            assert tiles_for(layout, world, rows, hidden, k, ctas, fitted=True, fp8=scaling,
                             long_k=True) == tiles_for(layout, world, rows, hidden, k, ctas,
                                                       fitted=True, fp8=scaling), (k, rows)
    assert changed > split_calls > 0
    seg = segments(layout, world, 12289, hidden=hidden, k=14336, ctas=ctas, fitted=True,
                   long_k=True)
    assert seg.tiles.fitted and not seg.tiles.cooperative and seg.release == "consumer"


def test_split_k_rule_takes_the_points_it_was_measured_faster_at():
    """The SPLIT_* rule, on a long-K device, over the counts to 5003 of one H100's bf16 sweep
    (docs/results/gemm_split_k_1gpu.json: every dense family's o_proj and fc2 at TP 2, 4 and
    8): split K's part wave exactly at the 19 points where it measured faster than the pick
    (the fc2 shards of Qwen2.5-32B, Llama-3.3-70B and Qwen2.5-72B at TP 2 and 4 at 2500, 3001
    and 5003 tokens, and Llama-3-8B's at TP 2 at 5003); none on another device."""
    from megatron_tokenweave.bench.gemm_fused import GEMMS
    from megatron_tokenweave.bench.split_cost import layer_gemms
    from megatron_tokenweave.models import SHAPES

    counts = (512, 513, 641, 777, 1000, 1024, 1279, 1531, 2047, 2500, 3001, 5003)
    taken = set()
    for model in ("qwen2.5-7b", "llama-3.3-70b", "qwen2.5-32b", "qwen2.5-72b", "llama-3-8b"):
        for gemm, tp, rows in itertools.product(GEMMS, (2, 4, 8), counts):
            k, n = layer_gemms(SHAPES[model], tp)[GEMMS[gemm]]
            if tiles_for(Layout.REPLICATED, tp, rows, n, k, 132, fitted=True,
                         long_k=True).split_tiles:
                taken.add((model, gemm, tp, rows))
            assert not tiles_for(Layout.REPLICATED, tp, rows, n, k, 132, fitted=True).split_tiles
    expected = {(m, "fc2", tp, rows) for m in ("qwen2.5-32b", "llama-3.3-70b", "qwen2.5-72b")
                for tp in (2, 4) for rows in (2500, 3001, 5003)}
    assert taken == expected | {("llama-3-8b", "fc2", 2, 5003)}


def test_part_wave_rule_takes_the_points_it_was_measured_faster_at():
    """FIT_BELOW_PINGPONG's rule over the bench's default counts (every dense family's o_proj
    and fc2 at TP 2, 4 and 8, replicated): the fitted kernel's ping-pong mode in the Triton
    pick's place exactly at the 18 points where it measured faster than that pick on one H200
    in bf16 and on one H100 in fp16 (docs/results/gemm_fused_1gpu.json and _fp16.json:
    Qwen2.5-32B at 3001 and 5003 tokens, Qwen2.5-7B at 5003 and 6143, K >= 1024); never in
    FP8, never in the sequence-parallel layout (not measured there)."""
    from megatron_tokenweave.bench.gemm_fused import GEMMS, SWEEP
    from megatron_tokenweave.bench.split_cost import layer_gemms
    from megatron_tokenweave.models import SHAPES
    from megatron_tokenweave.ops import segments as sg

    taken = set()
    for model in ("qwen2.5-7b", "llama-3.3-70b", "qwen2.5-32b", "qwen2.5-72b", "llama-3-8b"):
        for gemm, tp, rows in itertools.product(GEMMS, (2, 4, 8), SWEEP):
            k, n = layer_gemms(SHAPES[model], tp)[GEMMS[gemm]]
            for layout, fp8 in itertools.product(LAYOUTS, (None, "tensor")):
                triton = sg._triton_tiles(layout, tp, rows, n, k, 132)
                eff = sg.wave_efficiency(triton, layout, tp, rows, n, 132)
                fit = sg.fitted_tiles(layout, tp, rows, n, 132)
                if eff >= sg.FIT_BELOW and not fit.cooperative and sg._part_wave_call(
                        layout, tp, rows, n, k, 132, fp8, eff):  # under FIT_BELOW: its own rule
                    assert (layout, fp8) == (Layout.REPLICATED, None)
                    taken.add((model, gemm, tp, rows))
                    assert tiles_for(layout, tp, rows, n, k, 132, fitted=True) == fit
    qwen32 = {("qwen2.5-32b", g, tp, rows) for g in GEMMS for tp in (2, 4, 8)
              for rows in (3001, 5003)} - {("qwen2.5-32b", "o_proj", 8, r) for r in (3001, 5003)}
    qwen7 = {("qwen2.5-7b", g, tp, rows) for g, tp in (("o_proj", 2), ("fc2", 2), ("fc2", 4),
                                                        ("fc2", 8)) for rows in (5003, 6143)}
    assert taken == qwen32 | qwen7


def test_no_fitted_ping_pong_tiles_under_one_ping_pong_tile_a_cta():
    """Whichever rule would give it (the wave rule, the long-K ones, part-empty waves), the
    fitted kernel's ping-pong mode is never the pick of a call of fewer 128 x 128 tiles than
    CTAs (FIT_PINGPONG_MIN_CTA_TILES): at the sweeps' points it was slower than the Triton pick
    at all 14 such (Qwen2.5-7B at 512 tokens; Llama-3-8B's fc2 in e4m3), which it now keeps."""
    from megatron_tokenweave.bench.gemm_fused import GEMMS, SWEEP
    from megatron_tokenweave.bench.split_cost import layer_gemms
    from megatron_tokenweave.models import SHAPES
    from megatron_tokenweave.ops.segments import (
        FIT_PINGPONG_MIN_CTA_TILES,
        _pingpong_tiles_per_cta,
    )

    kept = set()
    for model in SHAPES:
        for gemm, tp, rows in itertools.product(GEMMS, (2, 4, 8), SWEEP[:3]):
            k, n = layer_gemms(SHAPES[model], tp)[GEMMS[gemm]]
            for layout, fp8, long_k in itertools.product(LAYOUTS, (None, "tensor"), (False, True)):
                t = tiles_for(layout, tp, rows, n, k, 132, fitted=True, fp8=fp8, long_k=long_k)
                few = _pingpong_tiles_per_cta(layout, tp, rows, n, 132) < FIT_PINGPONG_MIN_CTA_TILES
                assert not (few and t.fitted and not t.cooperative), (model, gemm, tp, rows)
                fit = fitted_tiles(layout, tp, rows, n, 132)
                if few and not fit.cooperative and layout is Layout.REPLICATED and rows == 512:
                    kept.add((model, gemm, tp, fp8))
    for tp in (2, 4, 8):  # the measured shards whose fitted tiles are ping-pong ones there
        assert ("qwen2.5-7b", "fc2", tp, None) in kept
    assert ("qwen2.5-7b", "o_proj", 2, None) in kept
    assert ("llama-3-8b", "fc2", 2, "tensor") in kept and ("llama-3-8b", "fc2", 4, "tensor") in kept


def test_long_k_devices_by_name():
    """The rule's devices by the names torch gives them: the H100s, not the H200."""
    assert fits_long_k("NVIDIA H100 80GB HBM3") and fits_long_k("NVIDIA H100 PCIe")
    assert not fits_long_k("NVIDIA H200") and not fits_long_k("NVIDIA A100-SXM4-80GB")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fitted_segments_are_released_by_their_consumer(layout):
    """The fitted kernel's rows are published by the consumer (one flag per source: the
    segment is one block of one tile in the consumer's geometry); forcing the GEMM's release
    keeps the Triton kernels, and forcing it on fitted tiles is refused. Its own geometry: the
    token groups (sequence parallel: one per owner) and the first tile, the one holding segment
    rank + 1's first row."""
    world, rows, hidden = 4, 1031, 8192
    t = fitted_tiles(layout, world, rows, hidden, 132)
    seg = segments(layout, world, rows, hidden=hidden, k=1024, ctas=132, tiles=t)
    assert seg.release == "consumer" and seg.tiles is t
    assert seg.geometry(1, hidden) == [1, seg.row0, seg.rows, seg.rows, 1, 1]
    picked = segments(layout, world, rows, hidden=hidden, k=1024, ctas=132, fitted=True,
                      release="gemm")
    assert not picked.tiles.fitted and picked.release == "gemm"
    with pytest.raises(TokenWeaveInputError, match="released by its consumer"):
        segments(layout, world, rows, hidden=hidden, k=1024, ctas=132, tiles=t, release="gemm")
    geo = seg.fitted_geometry(256, 2, 4000, world)
    sp = layout is Layout.SEQUENCE_PARALLEL
    groups, group_rows = (world, rows) if sp else (1, rows)
    assert geo[:9] == [256, 2, 4000, seg.row0, seg.first, seg.step, groups, group_rows, seg.rows]
    assert geo[9:11] == [t.block_rows, int(t.cooperative)] and geo[12:] == [0, 0, 0]
    if sp:  # group 3's first tile
        assert geo[11] == 3 * -(-rows // t.block_rows)
    else:  # the tile holding segment 3's first row
        assert geo[11] * t.block_rows <= 3 * seg.rows < (geo[11] + 1) * t.block_rows


def test_fitted_pairs_are_the_cooperative_mode_in_clusters():
    """fit_tiles(pair=True): the cooperative mode's tiles, which the op takes as mode 2 (its
    geometry's `cooperative` entry); never picked (fitted_tiles keeps pair off); refused for
    the ping-pong mode, block scales and the tokens as M."""
    t = fit_tiles(136, True, pair=True)
    assert t.pair and t.cooperative and t.block_rows == 136
    assert t.block_cols == fit_tiles(136, True).block_cols
    seg = segments(Layout.REPLICATED, 2, 513, hidden=8192, k=4096, ctas=132, tiles=t)
    assert seg.fitted_geometry(256, 0, 600, 2)[10] == 2
    for rows in (513, 777, 1279, 5003):
        assert not fitted_tiles(Layout.REPLICATED, 2, rows, 8192, 132).pair
    for kwargs in (dict(cooperative=False), dict(blocks=True), dict(blocks=True, tokens_m=True)):
        args = dict(cooperative=True) | kwargs
        with pytest.raises(TokenWeaveInputError, match="pairs of CTAs"):
            fit_tiles(128 if kwargs.get("tokens_m") else 96, args.pop("cooperative"),
                      FP8_BLOCK_K, pair=True, **args)


# --------------------------------------------------------------------------- emulation
def _emulation_worker(rank: int, world: int) -> list[tuple]:
    """Per case: (layout, rows, split, bias, fitted tiles, max |got - want| / max |want| of
    residual_out and normed: fp32 sums of every rank's partials in two orders). Where split and
    bias differ, x and the weight go in rows padded past K (a row pitch, ops/gemm_rows.py)."""
    import torch.distributed as dist

    group = dist.group.WORLD
    hidden, k = 32, 24
    comm = Communicator(group, 8 * 130, hidden, torch.float32, torch.device("cpu"), "reference")
    comm.prepare_gemm()
    results = []
    for layout, n, split, bias_on, fitted in itertools.product(
            LAYOUTS, (1, 7, 64, 130), (False, True), (False, True), (False, True)):
        sp = layout is Layout.SEQUENCE_PARALLEL
        chunks = world if sp else 1
        gen = torch.Generator().manual_seed(n * 7 + split)
        xs = [torch.randn(chunks * n, k, generator=gen) for _ in range(world)]
        ws = [torch.randn(hidden, k, generator=gen) for _ in range(world)]
        bias = torch.randn(hidden, generator=gen) if bias_on else None
        residual_all = torch.randn(chunks, n, hidden, generator=gen)
        norm = 1.0 + torch.randn(hidden, generator=gen)
        residual = residual_all[rank if sp else 0]
        # The reference: this rank's partial sums, the reference op.
        partial = (xs[rank] @ ws[rank].t()).view(chunks, n, hidden)
        if bias is not None and rank == 0:
            partial += bias
        want_res = torch.empty(n, hidden)
        want_normed = torch.empty(chunks, n, hidden)
        fused_allreduce_rmsnorm_reference(partial, residual, norm, EPS, want_res, want_normed,
                                          layout, group)
        # The mechanism, half by half, into the communicator's buffers.
        got_res = torch.full((n, hidden), float("nan"))
        normed = comm.normed[:chunks * n].view(chunks, n, hidden)
        normed.fill_(float("nan"))
        x, w = xs[rank], ws[rank]
        if split != bias_on:  # rows 112 bytes apart: 28 floats, K = 24 of them
            x, w = (torch.cat([t, torch.full((t.shape[0], 4), float("nan"))], 1)[:, :k]
                    for t in (x, w))
        for i, (h, seg) in enumerate(_calls(layout, world, n, split, hidden, k, 1, fitted)):
            comm.row_gemm(x, w, bias if rank == 0 else None, seg, i, ctas=1)
            part = comm.partial[chunks * h.offset:chunks * (h.offset + h.rows)].view(
                chunks, h.rows, hidden)
            rows = slice(h.offset, h.offset + h.rows)
            comm.allreduce_rmsnorm(part, residual[rows], norm, EPS, got_res[rows],
                                   h.of(normed), layout, comm="gemm", segments=seg, set_index=i)
        results.append((layout.value, n, split, bias_on, fitted,
                        ((got_res - want_res).abs().max() / want_res.abs().max()).item(),
                        ((normed - want_normed).abs().max() / want_normed.abs().max()).item()))
    return results


@pytest.mark.parametrize("world", (2, 4, 8))
def test_emulation_equals_the_reference(world):
    for rank_results in run_ranks(_emulation_worker, world=world):
        assert len(rank_results) == 64
        for layout, n, split, bias, fitted, err_res, err_normed in rank_results:
            where = (layout, n, split, bias, fitted)
            assert err_res <= 1e-5 and err_normed <= 1e-5, (where, err_res, err_normed)


def _pair_worker(rank: int, world: int) -> list[tuple]:
    """The 2-GPU pair benchmark's plans, run once each on gloo ranks (the emulation): which
    differ from cuBLAS + collectives + norm."""
    import torch.distributed as dist

    from megatron_tokenweave.bench.gemm_pair import Pair

    comm = Communicator(dist.group.WORLD, 8 * 33, 32, torch.float32, torch.device("cpu"),
                        "reference")
    comm.prepare_gemm()
    return [(layout.value, tokens, Pair(comm, layout, tokens, 24, seed=tokens,
                                        tiles=("auto", *TILES),
                                        release=("auto", *RELEASES)).check())
            for layout in LAYOUTS for tokens in (2 * world, 6 * world + world * 33 // 2)]


@pytest.mark.parametrize("world", (2, 4))
def test_pair_benchmark_plans_agree(world):
    """Every plan of `bench gemm_pair` (cuBLAS + fused op, the GEMM-fused mechanism with the
    policy's tiles and release and with each tile shape and release forced, each whole and
    split) computes what cuBLAS + collectives + norm computes."""
    for rank_results in run_ranks(_pair_worker, world=world):
        assert [bad for *_, bad in rank_results] == [[]] * 4, rank_results


# --------------------------------------------------------------------------- bad input
@pytest.fixture()
def gemm_comm(single_rank_group):
    return Communicator(single_rank_group, 256, 16, torch.float32, torch.device("cpu"),
                        "reference")


def _gemm_args(comm, **changes):
    seg = segments(Layout.REPLICATED, 1, 8, hidden=16, k=24, ctas=1)
    args = dict(x=torch.randn(8, 24), weight=torch.randn(16, 24), bias=None, segments=seg,
                set_index=0)
    args.update(changes)
    return args


def _row_gemm(comm, args):
    comm.row_gemm(args["x"], args["weight"], args["bias"], args["segments"],
                  args["set_index"], ctas=1)


def test_row_gemm_before_prepare_raises(gemm_comm):
    with pytest.raises(TokenWeaveInputError, match="prepare_gemm"):
        _row_gemm(gemm_comm, _gemm_args(gemm_comm))


@pytest.mark.parametrize("change,match", [
    (dict(x=torch.randn(8, 24, dtype=torch.float64)), "must be torch.float32"),
    (dict(weight=torch.randn(16, 20)), r"weight must be \[16, 24\]"),
    (dict(bias=torch.randn(8)), r"bias \[16\]"),
    (dict(x=torch.randn(8, 21), weight=torch.randn(16, 21)), "16-byte vectors"),
    (dict(x=torch.randn(24, 8).t()), "contiguous"),
    (dict(x=torch.randn(8, 25)[:, :24]), "16 bytes apart"),
    (dict(weight=torch.randn(16, 27)[:, 3:]), "16 bytes apart"),
    (dict(set_index=2), "set_index"),
    (dict(x=torch.randn(4, 24)), "read input rows up to 8"),
])
def test_row_gemm_bad_input_raises(gemm_comm, change, match):
    gemm_comm.prepare_gemm()
    with pytest.raises(TokenWeaveInputError, match=match):
        _row_gemm(gemm_comm, _gemm_args(gemm_comm, **change))


def test_row_gemm_past_the_inbox_raises_capacity_error(gemm_comm):
    gemm_comm.prepare_gemm()
    seg = segments(Layout.REPLICATED, 1, 8, hidden=16, k=24, ctas=1, set_index=1,
                   first_set_rows=slot_rows(256, 1))
    with pytest.raises(WorkspaceCapacityError, match="exceed"):
        _row_gemm(gemm_comm, _gemm_args(gemm_comm, segments=seg))


def test_gemm_consumer_of_another_call_raises(gemm_comm):
    gemm_comm.prepare_gemm()
    part = gemm_comm.partial[:4].view(1, 4, 16)
    residual, out = torch.randn(4, 16), torch.empty(4, 16)
    with pytest.raises(TokenWeaveInputError, match="cover 8 rows, this call has 4"):
        gemm_comm.allreduce_rmsnorm(part, residual, None, EPS, out, None, Layout.REPLICATED,
                                    comm="gemm", segments=_gemm_args(gemm_comm)["segments"])


def test_gemm_consumer_without_its_gemm_raises(gemm_comm):
    part = gemm_comm.partial[:4].view(1, 4, 16)
    residual, out = torch.randn(4, 16), torch.empty(4, 16)
    with pytest.raises(TokenWeaveInputError, match="consumes a row_gemm call"):
        gemm_comm.allreduce_rmsnorm(part, residual, None, EPS, out, None, Layout.REPLICATED,
                                    comm="gemm")


@pytest.mark.parametrize("passes", [None, 3], ids=["one_pass", "three_passes"])
@pytest.mark.parametrize("cutlass", [False, True], ids=["plain", "cutlass"])
def test_gemm_fused_plot_draws_one_or_several_models(tmp_path, cutlass, passes):
    """bench gemm_fused's plot, for one model or two, with and without CUTLASS rows (the second
    row of panels), from rows without a pass (one pass, as results before --passes) or with
    three, of the benchmark's schema (random times)."""
    pytest.importorskip("matplotlib")
    from megatron_tokenweave.bench import gemm_fused

    impls = ["cublas", "tokenweave"] + (["cutlass_pingpong_128x128_c1x1",
                                          "cutlass_coop_128x256_c2x1"] if cutlass else [])
    tags = [{}] if passes is None else [{"pass": p} for p in range(passes)]
    gen = torch.Generator().manual_seed(0)
    for models in (["llama-3-8b"], ["llama-3.3-70b", "llama-3-8b"]):
        rows = [dict(model=m, gemm=g, tp=tp, tokens=t, impl=i,
                     us=10.0 + torch.rand((), generator=gen).item(), **tag)
                for m in models for g in gemm_fused.GEMMS for tp in (2, 8)
                for t in (1024, 4096) for i in impls for tag in tags]
        path = tmp_path / f"{len(models)}_{cutlass}_{passes}.png"
        gemm_fused._plot(dict(gpu="H200", rows=rows), str(path))
        assert path.stat().st_size > 0


def test_gemm_fused_blocks_without_a_reference(tmp_path):
    """bench gemm_fused --dtypes fp8_blocks: the shards whose K/128 is not a multiple of 4 have
    no cuBLAS reference (`cublas_blocks_ok`) and are left out, so a result may hold one GEMM of a
    (model, TP) or none; its summary line and plot take that. cuBLAS runs the count rounded up
    to 4 rows (`block_rows`)."""
    pytest.importorskip("matplotlib")
    from megatron_tokenweave.bench import gemm_fused

    assert [gemm_fused.cublas_blocks_ok(k) for k in (512, 1792, 3584, 14784, 7392, 2368)] == [
        True, False, True, True, False, False]
    assert [gemm_fused.cublas_rows(t) for t in (512, 513, 515, 516)] == [512, 516, 516, 516]
    us = {("o_proj", "cublas"): 10.0, ("o_proj", "tokenweave"): 20.0}
    assert gemm_fused._summary(us) == "o_proj cublas/tokenweave 0.500 ()"
    rows = [dict(model="qwen2.5-7b", gemm="o_proj", tp=8, tokens=t, dtype="fp8_blocks", impl=i,
                 us=10.0 + t / 1000) for t in (512, 1024) for i in ("cublas", "tokenweave")]
    path = tmp_path / "blocks.png"
    gemm_fused._plot(dict(gpu="H100", rows=rows), str(path))
    assert path.stat().st_size > 0
    gemm_fused._plot(dict(gpu="H100", rows=[]), str(tmp_path / "none.png"))  # nothing measured
    assert not (tmp_path / "none.png").exists()


@pytest.mark.parametrize("tokens,hidden", [(513, 4096), (777, 8192), (5003, 3584)])
@pytest.mark.parametrize("block_k,most,blocks", [(64, 176, False), (128, 208, True)])
def test_gemm_fused_breakdown_forces_fitted_extents_in_both_modes(tokens, hidden, block_k, most,
                                                                  blocks):
    """bench gemm_fused --breakdown's fitted variants: both modes, each at every forced extent
    up to the largest the call's operands take in that mode (FIT_WIDE_MAX_ROWS cooperative or
    in blocks, else FIT_MAX_ROWS) and at the extent its model picks for the call, each a tile
    the kernel takes (of 64 weight rows a consumer past FIT_MAX_ROWS tokens, in blocks past
    FIT_BLOCKS_HALVES_MAX_ROWS), named apart; not in blocks the cooperative ones of at most
    FIT_MAX_ROWS tokens in pairs of CTAs as well."""
    from megatron_tokenweave.bench import gemm_fused
    from megatron_tokenweave.ops.segments import FIT_BLOCKS_HALVES_MAX_ROWS, FIT_MIN_ROWS, fit_pick

    variants = gemm_fused._fitted_variants(tokens, hidden, 132, block_k, most, blocks)
    names = [gemm_fused._tiles_name(t) for t in variants]
    assert len(set(names)) == len(names)
    for cooperative in (False, True):
        mode_most = FIT_WIDE_MAX_ROWS if cooperative else most
        mine = {t.block_rows for t in variants if t.cooperative == cooperative and not t.pair}
        picked = fit_pick(Layout.REPLICATED, 1, tokens, hidden, 132, cooperative, mode_most,
                          blocks)[1]
        assert mine == {*(r for r in gemm_fused.FIT_BREAKDOWN_ROWS if r <= mode_most), picked}
    pairs = {t.block_rows for t in variants if t.pair}
    assert pairs == (set() if blocks else {t.block_rows for t in variants
                                           if t.cooperative and t.block_rows <= FIT_MAX_ROWS})
    assert all(t.cooperative for t in variants if t.pair)
    for t in variants:
        assert t.fitted and t.block_k == block_k
        halves = FIT_BLOCKS_HALVES_MAX_ROWS if blocks else FIT_MAX_ROWS
        rows = 64 if t.block_rows > halves else 128
        assert t.block_cols == (2 * rows if t.cooperative else rows)
        assert t.block_rows % 8 == 0 and FIT_MIN_ROWS <= t.block_rows <= (
            FIT_WIDE_MAX_ROWS if t.cooperative else most)


def test_split_k_summary_reads_split_beside_the_pick(tmp_path, monkeypatch, capsys):
    """docs/results/split_k/summary.py: per-model JSONs of bench gemm_fused with split K timed
    beside the pick become one file (cuBLAS, the pick and split K's rows only) and a plot; it
    prints each point's ratios and the fastest split's speed over its tiles unsplit, and counts
    the points at or above 0.98x of cuBLAS with the pick and with the fastest of the pick and
    the split rows; points without split K's rows are left out."""
    pytest.importorskip("matplotlib")
    import importlib.util
    import json
    import pathlib
    import sys

    path = pathlib.Path(__file__).parents[1] / "docs" / "results" / "split_k" / "summary.py"
    spec = importlib.util.spec_from_file_location("split_k_summary", path)
    summary = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(summary)
    # (tokens, gemm) -> us of the pick, split K's tiles unsplit, split in the part wave and in
    # two waves, against cuBLAS's 10: the pick at 0.99x, split K at 0.98x where the pick is
    # 0.90x, and a point timed without split K
    times = {(777, "fc2"): (11.111, 11.0, 10.204, 10.5), (513, "fc2"): (10.1, 10.8, 10.6, None),
             (5003, "o_proj"): (10.0, None, None, None)}
    impls = ("tokenweave", "tokenweave_split_none", "tokenweave_split_part",
             "tokenweave_split_two")
    src = tmp_path / "src"
    src.mkdir()
    for model in ("qwen2.5-7b", "llama-3.3-70b"):
        rows = []
        for (tokens, gemm), us in times.items():
            for impl, t in (("cublas", 10.0), *zip(impls, us, strict=True),
                            ("tokenweave_triton", 12.0)):
                if t is not None:
                    rows.append(dict(model=model, gemm=gemm, tp=2, tokens=tokens, dtype="bf16",
                                     impl=impl, us=t, tiles="fit200c", **{"pass": 0}))
        (src / f"{model}.json").write_text(json.dumps(dict(gpu="H200", date="d", rows=rows)))
    out = tmp_path / "split_k.json"
    monkeypatch.setattr(sys, "argv", ["summary.py", str(src), str(out), "cmd"])
    summary.main()
    printed = capsys.readouterr().out
    assert "the pick 2, the fastest of the pick and the split rows 4, of 4" in printed
    assert "pick 0.900  none 0.909  part 0.980  two 0.952  best/none 1.078" in printed
    assert "fastest region: {'tokenweave_split_part': 4}" in printed
    joined = json.loads(out.read_text())
    assert joined["command"] == "cmd" and len(joined["rows"]) == 2 * 11
    assert {r["impl"] for r in joined["rows"]} == {"cublas", *impls}
    assert out.with_suffix(".png").stat().st_size > 0


def test_gemm_join_restores_each_rows_gemm_from_its_order(tmp_path, monkeypatch):
    """docs/results/gemm_join.py --gemm-from-order: rows written in bench gemm_fused's order
    (per point o_proj's, then fc2's, each impl once a pass) with a wrong `gemm` field get
    o_proj and fc2 back, the timings untouched; a point without both is refused. The
    joined file keeps every row, and the summary reads the wide tiles' speed over the narrow
    ones from the fitted kernel's rows (the pick's, or the one timed beside a Triton pick)."""
    pytest.importorskip("matplotlib")
    import importlib.util
    import json
    import pathlib
    import sys

    path = pathlib.Path(__file__).parents[1] / "docs" / "results" / "gemm_join.py"
    spec = importlib.util.spec_from_file_location("gemm_join", path)
    join = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(join)

    def point(tokens, tiles, impls, us):
        return [dict(model="m", tp=2, tokens=tokens, dtype="bf16", gemm="wide", impl=i,
                     us=us[g][i] * (1 + p / 100), tiles=tiles[g], **{"pass": p})
                for g in ("o_proj", "fc2") for p in (0, 1) for i in impls]

    fit = {"o_proj": "fit104c", "fc2": "fit104c"}
    times = {"o_proj": dict(cublas=10.0, tokenweave=12.0, tokenweave_wide=11.0),
             "fc2": dict(cublas=20.0, tokenweave=22.0, tokenweave_wide=21.0)}
    rows = point(777, fit, ("cublas", "tokenweave", "tokenweave_wide"), times)
    triton = {"o_proj": "pingpong", "fc2": "pingpong"}
    beside = {g: dict(cublas=t["cublas"], tokenweave=t["cublas"], tokenweave_fitted=12.0,
                      tokenweave_wide=10.0) for g, t in times.items()}
    rows += point(1531, triton, ("cublas", "tokenweave", "tokenweave_fitted",
                                 "tokenweave_wide"), beside)
    src = tmp_path / "src.json"
    src.write_text(json.dumps(dict(gpu="H200", date="d", command="c", rows=rows)))
    join.gemm_from_order(rows)
    assert [r["gemm"] for r in rows[:6]] == ["o_proj"] * 6
    assert [r["gemm"] for r in rows[6:12]] == ["fc2"] * 6
    assert all(r["us"] in (t[r["impl"]], t[r["impl"]] * 1.01) for r in rows[:12]
               for t in (times[r["gemm"]],))
    pick, both = join.bounds(rows)
    assert pick[("bf16", 777, "m", "o_proj", 2)] == pytest.approx(10.0 / 12.0)
    assert both[("bf16", 777, "m", "fc2", 2)] == pytest.approx((20.0 / 22.0, 20.0 / 21.0))
    assert both[("bf16", 1531, "m", "o_proj", 2)] == pytest.approx((10.0 / 12.0, 10.0 / 10.0))
    out = tmp_path / "out.json"
    monkeypatch.setattr(sys, "argv", ["gemm_join.py", str(out), "cmd", str(src),
                                      "--gemm-from-order"])
    join.main()
    joined = json.loads(out.read_text())
    assert joined["command"] == "cmd" and len(joined["rows"]) == len(rows)
    assert (tmp_path / "out.png").stat().st_size > 0
    with pytest.raises(SystemExit, match="do not split"):
        join.gemm_from_order(rows[:6])  # o_proj's rows alone
    # a Triton pick without the fitted kernel beside it (no fitted kernel on that device)
    plain = point(4096, {"o_proj": "large", "fc2": "large"}, ("cublas", "tokenweave"), times)
    join.gemm_from_order(plain)
    pick, both = join.bounds(plain)
    assert len(pick) == 2 and not both


def test_fit_tiles_take_64_row_consumers_in_the_cooperative_mode_only():
    """Past FIT_MAX_ROWS tokens a fitted tile's consumers take 64 weight rows, which the kernel
    has in its cooperative mode outside pairs (and in blocks, both modes): fit_tiles refuses
    the others, and fitted_tiles takes a cooperative bound in FIT_MAX_ROWS..FIT_WIDE_MAX_ROWS."""
    assert fit_tiles(208, True).block_cols == 128
    assert fit_tiles(208, False, FP8_BLOCK_K, blocks=True).block_cols == 64
    for kw in (dict(cooperative=False), dict(cooperative=True, pair=True)):
        with pytest.raises(TokenWeaveInputError, match="past 176 tokens"):
            fit_tiles(184, **kw)
    for bad in (FIT_MAX_ROWS - 8, FIT_WIDE_MAX_ROWS + 8):
        with pytest.raises(TokenWeaveInputError, match="coop_max_rows"):
            fitted_tiles(Layout.REPLICATED, 2, 777, 8192, 132, bad)


def test_fit_tiles_refuse_extents_the_kernel_does_not_have():
    """The fitted kernel is instantiated for token extents that are multiples of 8 from
    FIT_MIN_ROWS: fit_tiles (and split K's forced extent) refuse any other when the tiles are
    built, not only the op later."""
    assert fit_tiles(FIT_MIN_ROWS, False).block_rows == FIT_MIN_ROWS
    for extent in (0, 4, 8, 12, 100, 173):
        for cooperative in (False, True):
            with pytest.raises(TokenWeaveInputError, match="a multiple of 8 from"):
                fit_tiles(extent, cooperative)
    with pytest.raises(TokenWeaveInputError, match="a multiple of 8 from"):
        split_k_tiles(Layout.REPLICATED, 2, 777, 3584, 9472, 132, extent=100)


def test_an_empty_call_launches_nothing_whichever_kernel_its_tiles_name():
    """owner_gemm of a call without rows returns before any kernel, the fitted one's included
    (its op refuses zero rows; the Triton path always returned): no flags, as the consumer of an
    empty call expects none."""
    from types import SimpleNamespace

    from megatron_tokenweave.kernels.owner_gemm import owner_gemm

    inbox = SimpleNamespace(world=2)  # an empty call reads nothing else of it
    x = torch.empty(0, 4096, dtype=torch.bfloat16)
    w = torch.empty(4096, 4096, dtype=torch.bfloat16, device="meta")
    for fitted in (True, False):
        tiles = fit_tiles(64, True) if fitted else None
        seg = segments(Layout.REPLICATED, 2, 0, hidden=4096, k=4096, ctas=132, tiles=tiles)
        assert seg.tiles.fitted is fitted and seg.nonempty_blocks(2) == 0
        owner_gemm(x, w, None, inbox, seg, 0, 132, tag=1)


@pytest.mark.parametrize("layout", list(Layout))
def test_split_k_tiles_split_the_part_wave(layout):
    """split_k_tiles: cooperative tiles of the extent that covers the rows with the least area
    (a tile's fixed cost counted) or of the one given, none where every wave is full; the split
    tiles the part wave ("part", "even") or it and one whole wave ("two", where there is one),
    their K steps dealt out to at most the CTAs given: "even" and "two" as few steps a CTA as
    fit, "part" at least that and at least the model's (sqrt(SPLIT_ADD_STEPS x K steps), capped
    at a tile's); the op's geometry carries the split tiles and steps last. fit_tiles refuses
    split K outside the cooperative mode, in pairs, in blocks, and with one of the two 0 or
    negative."""
    for world, rows, hidden, k, ctas in ((2, 777, 3584, 9472, 132), (8, 513, 8192, 1024, 132),
                                         (4, 1, 1000, 200, 132), (2, 5003, 8192, 7168, 132),
                                         (2, 1024, 5120, 13824, 132)):
        for region in SPLIT_REGIONS:
            t = split_k_tiles(layout, world, rows, hidden, k, ctas, region=region)
            base = split_k_tiles(layout, world, rows, hidden, k, 1)  # one CTA: no part wave
            assert base is None
            assert t.fitted and t.cooperative and not t.pair
            seg = segments(layout, world, rows, hidden=hidden, k=k, ctas=ctas, tiles=t)
            tiles, k_steps = seg.tile_count(world, hidden), -(-k // 64)
            part = tiles % ctas
            assert part and t.split_tiles == (part + ctas if region == "two" and tiles > ctas
                                              else part)
            fewest = -(-t.split_tiles * k_steps // ctas)
            model = min(k_steps, math.ceil(math.sqrt(SPLIT_ADD_STEPS * k_steps)))
            assert t.split_steps == (max(fewest, model) if region == "part" else fewest)
            assert 1 <= seg.split_ctas(k) <= ctas
            assert seg.fitted_geometry(256, 0, 6000, world)[13:] == [t.split_tiles,
                                                                      t.split_steps]
    # 777 tokens: 4 x 200 (3 % padding) beats 5 x 160 and 7 x 112 in area
    assert split_k_tiles(Layout.REPLICATED, 2, 777, 3584, 9472, 132).block_rows == 200
    # an extent given: 6 token tiles of 136 by 14 weight tiles of 256 rows, all in the part wave
    t = split_k_tiles(Layout.REPLICATED, 2, 777, 3584, 9472, 132, extent=136)
    assert (t.block_rows, t.block_cols, t.split_tiles) == (136, 256, 84)
    with pytest.raises(TokenWeaveInputError, match="at most 208 tokens"):
        split_k_tiles(Layout.REPLICATED, 2, 777, 3584, 9472, 132, extent=216)
    # 5003 tokens (of each of 2 chunks, sequence parallel) of hidden 8192 in tiles of 168 x
    # 256: 30 x 32 tiles (60 x 32), 8 (16) whole waves of 120
    assert split_k_tiles(layout, 2, 5003, 8192, 7168, 120) is None
    with pytest.raises(TokenWeaveInputError, match="region"):
        split_k_tiles(Layout.REPLICATED, 2, 777, 3584, 9472, 132, region="all")
    for kw in (dict(cooperative=False), dict(cooperative=True, pair=True),
               dict(cooperative=True, blocks=True), dict(cooperative=True, split=(4, 0)),
               dict(cooperative=True, split=(-1, 4))):
        args = {"split": (4, 4)} | kw
        with pytest.raises(TokenWeaveInputError, match="split K"):
            fit_tiles(96, args.pop("cooperative"), FP8_BLOCK_K, **args)


def test_gemm_fused_plot_draws_a_joined_file(tmp_path):
    """bench gemm_fused's plot of rows joined from several runs (docs/results/gemm_fused_1gpu.json
    is one): a model timed in bf16 only beside one timed in both dtypes, and a run with fewer TP
    sizes and counts than another; the missing panel is left empty."""
    pytest.importorskip("matplotlib")
    from megatron_tokenweave.bench import gemm_fused

    gen = torch.Generator().manual_seed(1)
    runs = [("llama-3-8b", "bf16", (2, 4, 8), (512, 513, 1024)),
            ("llama-3-8b", "fp16", (2, 8), (512, 1024)),
            ("qwen2.5-7b", "bf16", (4,), (777,))]
    rows = [dict(model=m, gemm=g, tp=tp, tokens=t, dtype=d, impl=i,
                 us=10.0 + torch.rand((), generator=gen).item())
            for m, d, tps, counts in runs for g in gemm_fused.GEMMS for tp in tps
            for t in counts for i in ("cublas", "tokenweave")]
    path = tmp_path / "joined.png"
    gemm_fused._plot(dict(gpu="H200", rows=rows), str(path))
    assert path.stat().st_size > 0


def test_fitted_launcher_refuses_bad_input():
    """kernels/owner_gemm.check_fitted_gemm: what the fitted kernel cannot take is a
    TokenWeaveInputError before the op (operands bf16/fp16 of the rows' dtype, or e4m3 with
    rows of bf16/fp16; 2-D, rows contiguous and a multiple of 16 bytes apart (padded rows
    taken); 16-byte rows: K a multiple of 8, or 16 in e4m3, N of 8;
    bias [N] of the rows' dtype; 16-byte starts; token extents in its range (to 176, to 208 in
    the cooperative mode outside pairs and in blocks); the tokens as M in blocks only, at its
    weight extents and 64 tokens a consumer; pairs of CTAs in the cooperative mode, not in
    blocks, on at least 2 CTAs; rows inside x and the slot)."""
    from dataclasses import replace

    from megatron_tokenweave.kernels.owner_gemm import check_fitted_gemm

    tiles = fitted_tiles(Layout.REPLICATED, 2, 300, 512, 132)
    seg = segments(Layout.REPLICATED, 2, 300, hidden=512, k=256, ctas=132, tiles=tiles)
    x = torch.randn(300, 256, dtype=torch.bfloat16)
    w = torch.randn(512, 256, dtype=torch.bfloat16)
    e4m3 = torch.float8_e4m3fn
    fp8 = dict(x=x.to(e4m3), w=w.to(e4m3), fp8="tensor", out=torch.bfloat16)
    base = dict(x=x, w=w, bias=None, seg=seg, fp8=None, out=None)
    blocks = fp8 | dict(fp8="blocks", seg=replace(seg, tiles=replace(tiles, block_rows=208)))
    tokens_m = fit_tiles(208, True, FP8_BLOCK_K, blocks=True, tokens_m=True)
    blocks_m = blocks | dict(seg=replace(seg, tiles=tokens_m))

    pair = replace(seg, tiles=fit_tiles(136, True, pair=True))

    def check(args: dict) -> None:
        check_fitted_gemm(args["x"], args["w"], args["bias"], args["seg"], slot_rows=400,
                          world=2, fp8=args["fp8"], out_dtype=args["out"],
                          ctas=args.get("ctas", 132))

    check(base)  # calls it takes: 16-bit, padded rows, and e4m3 with bf16 rows and bias
    check(base | dict(x=torch.randn(300, 264, dtype=torch.bfloat16)[:, :256]))
    check(base | fp8 | dict(bias=torch.randn(512, dtype=torch.bfloat16)))
    check(base | blocks)
    check(base | blocks_m)
    check(base | dict(seg=pair))  # pairs: 16-bit and per tensor
    wide = replace(seg, tiles=fit_tiles(208, True))  # cooperative, 64-row consumers
    check(base | dict(seg=wide))
    check(base | fp8 | dict(seg=wide))
    check(base | fp8 | dict(seg=pair))
    check(base | blocks_m | dict(seg=replace(seg, tiles=replace(tokens_m, cooperative=False,
                                                                 block_rows=64))))
    bad = [
        (dict(x=x.float()), "bf16 or fp16"),
        (dict(bias=torch.randn(512, dtype=torch.float16)), "of one dtype"),
        (dict(out=torch.float16), "of one dtype"),
        (dict(x=torch.randn(256, 300, dtype=torch.bfloat16).t()), "rows are contiguous"),
        (dict(w=torch.randn(512, 260, dtype=torch.bfloat16)[:, :256]), "16 bytes apart"),
        (dict(x=x[:, :100].contiguous(), w=w[:, :100].contiguous()), "K a multiple of 8"),
        (dict(w=w[:500].contiguous()), "N of 8"),
        (dict(bias=torch.randn(500, dtype=torch.bfloat16)), r"bias must be \[512\]"),
        (dict(x=torch.randn(301 * 256 + 1, dtype=torch.bfloat16)[1:].view(301, 256)),
         "16-byte aligned"),
        (dict(seg=replace(seg, tiles=replace(tiles, block_rows=184))), r"16\.\.176, got"),
        (dict(seg=replace(seg, tiles=replace(tiles, block_rows=20))), "multiple of 8 tokens"),
        (dict(seg=replace(wide, tiles=replace(wide.tiles, block_rows=216))),
         r"16\.\.208 \(cooperative\)"),
        (dict(seg=replace(pair, tiles=replace(pair.tiles, block_rows=184))), r"16\.\.176, got"),
        (dict(x=x[:200]), "x has 200"),
        (dict(seg=replace(seg, row0=300)), "a slot has 400"),
        (fp8 | dict(w=w), "e4m3 operands"),
        (fp8 | dict(out=torch.float32), "e4m3 operands"),
        (fp8 | dict(bias=torch.randn(512, dtype=torch.float16)), "e4m3 operands"),
        (fp8 | dict(x=fp8["x"][:, :200].contiguous(), w=fp8["w"][:, :200].contiguous()),
         "K a multiple of 16"),
        (blocks | dict(seg=replace(seg, tiles=replace(tiles, block_rows=216))),
         r"16\.\.208 \(block scales\)"),
        (fp8 | dict(seg=blocks_m["seg"]), "tokens as M take e4m3 operands in blocks"),
        (dict(seg=blocks_m["seg"]), "tokens as M take e4m3 operands in blocks"),
        (blocks_m | dict(seg=replace(seg, tiles=replace(tokens_m, block_cols=200))),
         "weight extents"),
        (blocks_m | dict(seg=replace(seg, tiles=replace(tokens_m, block_rows=64))),
         "64 tokens a consumer"),
        (dict(seg=pair, ctas=1), "pairs of CTAs"),
        (blocks | dict(seg=replace(seg, tiles=replace(pair.tiles, block_rows=104))),
         "pairs of CTAs"),
        (dict(seg=replace(seg, tiles=replace(pair.tiles, cooperative=False))), "pairs of CTAs"),
    ]
    for change, match in bad:
        with pytest.raises(TokenWeaveInputError, match=match):
            check(base | change)
