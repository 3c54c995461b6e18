"""FP8 operands of the communicating GEMM on CPU (ops/fp8_operands.py, ops/segments.py,
ops/gemm_emulation.py): the scales' layouts (TE's per-tensor and GEMM-ready blockwise ones)
dequantize as defined element by element, the checks refuse what the kernel cannot take, FP8
calls get the one-consumer tiles with 128-deep K blocks, and the emulated mechanism (`row_gemm`
with `fp8=` + `allreduce_rmsnorm(comm="gemm")`, gloo ranks at TP 2 and 4) equals the reference
op over the dequantized partial sums.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch
from _dist import run_ranks

from megatron_tokenweave.communicator import Communicator
from megatron_tokenweave.ops import Layout, TokenWeaveInputError, fused_allreduce_rmsnorm_reference
from megatron_tokenweave.ops.fp8_operands import Fp8Operands
from megatron_tokenweave.ops.fp8_rows import FP8_DTYPE
from megatron_tokenweave.ops.gemm_rows import whole_boxes
from megatron_tokenweave.ops.segments import (
    FIT_BLOCKS_HALVES_MAX_ROWS,
    FIT_BLOCKS_PICK_MAX_ROWS,
    FIT_BLOCKS_WIDE_MAX_WAVES,
    FIT_FP8_MIN_K,
    FIT_MAX_ROWS,
    FIT_MIN_CALL,
    FIT_MIN_ROWS,
    FIT_TILE_COST,
    FIT_TOKENS_M_EXTENTS,
    FIT_TOKENS_M_ROWS,
    FIT_WIDE_MAX_ROWS,
    FP8_BLOCK_K,
    FP8_PARTIAL_BOX_MIN_K,
    FP8_SCALINGS,
    LARGE,
    SMALL,
    WIDE,
    estimated_time,
    fit_pick,
    fit_tile_rows,
    fit_tiles,
    fitted_tiles,
    one_consumer_tiles,
    segments,
    tiles_for,
)

EPS = 1e-5


def _operands(rows: int, n: int, k: int, blocks: bool, seed: int
              ) -> tuple[torch.Tensor, torch.Tensor, Fp8Operands]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).to(FP8_DTYPE)
    w = torch.randn(n, k, generator=gen).to(FP8_DTYPE)
    xs, ws = (0.5 + torch.rand(s, generator=gen)
              for s in Fp8Operands(x, w, blocks).shapes(rows, n, k))
    return x, w, Fp8Operands(xs, ws, blocks)


@pytest.mark.parametrize("rows,n,k", [(1, 128, 128), (7, 200, 384), (130, 1000, 1280),
                                      (9, 256, 208), (5, 300, 3696)])
def test_block_scales_dequantize_element_by_element(rows, n, k):
    """Element (r, c) of x times x_scale_inv[c // 128, r]; element (j, c) of the weight times
    w_scale_inv[j // 128, c // 128] (the scales' padded columns never read; a last K block
    short of 128, K = 208 and 3696, with its own scales)."""
    x, w, ops = _operands(rows, n, k, True, rows + n)
    ops.check(x, w)  # a last K block short of 128 is taken
    xf, wf = ops.dequantized(x, w)
    assert xf.shape == x.shape and wf.shape == w.shape
    c = k - 1  # the last column: in the short block
    assert xf[0, c] == x[0, c].float() * ops.x_scale_inv[c // 128, 0]
    assert wf[0, c] == w[0, c].float() * ops.w_scale_inv[0, c // 128]
    for r, c in itertools.product(range(0, rows, max(1, rows // 5)), range(0, k, 37)):
        assert xf[r, c] == x[r, c].float() * ops.x_scale_inv[c // 128, r]
    for j, c in itertools.product(range(0, n, 29), range(0, k, 41)):
        assert wf[j, c] == w[j, c].float() * ops.w_scale_inv[j // 128, c // 128]


def test_tensor_scales_dequantize():
    x, w, ops = _operands(5, 64, 48, False, 1)
    xf, wf = ops.dequantized(x, w)
    assert torch.equal(xf, x.float() * ops.x_scale_inv[0])
    assert torch.equal(wf, w.float() * ops.w_scale_inv[0])


def test_block_scale_shapes_are_te_gemm_ready_layouts():
    """x: [ceil(K/128), rows rounded up to 4]; weight: [ceil(N/128), ceil(K/128) rounded up
    to 4] (a last K block short of 128 has its own scales, as TE's quantizers give it)."""
    ops = Fp8Operands(torch.empty(0), torch.empty(0), True)
    assert ops.shapes(7, 1000, 1280) == ((10, 8), (8, 12))
    assert ops.shapes(7, 8192, 3696) == ((29, 8), (64, 32))
    assert ops.shapes(8, 128, 128) == ((1, 8), (1, 4))
    assert Fp8Operands(torch.empty(0), torch.empty(0)).shapes(7, 1000, 1280) == ((1,), (1,))


@pytest.mark.parametrize("blocks", [False, True])
def test_checks_refuse_what_the_kernel_cannot_take(blocks):
    x, w, ops = _operands(9, 256, 256, blocks, 3)
    ops.check(x, w)  # well formed
    wrong_shape = torch.ones(3, 3)
    bad = [((x.float(), w, ops), "float8_e4m3fn"),
           ((x, w.to(torch.bfloat16), ops), "float8_e4m3fn"),
           ((x, w, Fp8Operands(ops.x_scale_inv.double(), ops.w_scale_inv, blocks)), "float32"),
           ((x, w, Fp8Operands(wrong_shape, ops.w_scale_inv, blocks)), "x scale_inv"),
           ((x, w, Fp8Operands(ops.x_scale_inv, wrong_shape, blocks)), "weight scale_inv")]
    if blocks:
        t = torch.ones(4, 4)[:, :2]
        bad.append(((x, w, Fp8Operands(ops.x_scale_inv, t, blocks)), "contiguous"))
        # Contiguous and of the right shape, but 4 bytes past a 16-byte boundary.
        shifted = torch.ones(ops.x_scale_inv.numel() + 4)[1:1 + ops.x_scale_inv.numel()]
        shifted = shifted.view(ops.x_scale_inv.shape)
        assert shifted.is_contiguous() and shifted.data_ptr() % 16 == 4
        bad.append(((x, w, Fp8Operands(shifted, ops.w_scale_inv, blocks)), "16-byte aligned"))
    for (xx, ww, oo), match in bad:
        with pytest.raises(TokenWeaveInputError, match=match):
            oo.check(xx, ww)


@pytest.mark.parametrize("layout", [Layout.REPLICATED, Layout.SEQUENCE_PARALLEL])
@pytest.mark.parametrize("world", [2, 8])
def test_fp8_calls_take_tiles_with_128_deep_k(layout, world):
    """Per-tensor scales: the 16-bit pick (ping-pong where it would take the call, the fitted
    kernel where its wave rule says so), and the fitted kernel also over more than
    FIT_FP8_MIN_K in-features where its tiles run its ping-pong mode, but the one-consumer
    tiles over more than FP8_PARTIAL_BOX_MIN_K whose rows are not whole 128-byte boxes apart
    (K = 7392; with or without the fitted kernel, not where its wave rule takes the call);
    block scales: the fitted kernel's cooperative tiles where it runs, of at most
    FIT_BLOCKS_PICK_MAX_ROWS tokens, or FIT_WIDE_MAX_ROWS where those take at most
    FIT_BLOCKS_WIDE_MAX_WAVES waves and no more than the narrower ones; else the fastest
    one-consumer tiles by estimated time; all with K blocks of FP8_BLOCK_K."""
    picked = {"tensor": set(), "blocks": set()}
    for rows, (hidden, k, ctas), fitted in itertools.product(
            (1, 7, 129, 513, 777, 1031, 4096, 8192), ((4096, 1792, 132), (8192, 3584, 132),
                                                      (5120, 3584, 8), (8192, 7392, 132)),
            (False, True)):
        sixteen = tiles_for(layout, world, rows, hidden, k, ctas, fitted=fitted)
        fit = fitted_tiles(layout, world, rows, hidden, ctas)
        call_rows = rows * (world if layout is Layout.SEQUENCE_PARALLEL else 1)
        long = fitted and call_rows >= FIT_MIN_CALL and not sixteen.fitted
        partial_box = k > FP8_PARTIAL_BOX_MIN_K and not whole_boxes(k, 1) and not sixteen.fitted
        long_k = long and not partial_box and k > FIT_FP8_MIN_K and not fit.cooperative
        for scaling in FP8_SCALINGS:
            t = tiles_for(layout, world, rows, hidden, k, ctas, fitted=fitted, fp8=scaling)
            assert t.block_k == FP8_BLOCK_K and not t.tokens_m  # built, not measured: not picked
            if scaling == "tensor":
                want = (one_consumer_tiles(layout, world, rows, hidden, ctas) if partial_box
                        else fit if long_k else sixteen)
                assert t == replace(want, block_k=FP8_BLOCK_K)
                picked[scaling].add("partial box" if partial_box else "long K" if long_k else
                                    "fitted" if t.fitted else t.consumers)
            elif fitted:
                assert t.fitted and t.cooperative
                narrow, wide = (fit_pick(layout, world, rows, hidden, ctas, True, most,
                                         blocks=True)
                                for most in (FIT_BLOCKS_PICK_MAX_ROWS, FIT_WIDE_MAX_ROWS))
                take_wide = wide[0] <= FIT_BLOCKS_WIDE_MAX_WAVES and wide[0] <= narrow[0]
                assert t.block_rows == (wide if take_wide else narrow)[1]
                assert t.block_rows <= (FIT_WIDE_MAX_ROWS if take_wide
                                        else FIT_BLOCKS_PICK_MAX_ROWS)
                assert t.block_cols == fit_tile_rows(t.block_rows, True, blocks=True)
                picked[scaling].add("fitted coop wide" if t.block_rows > FIT_BLOCKS_PICK_MAX_ROWS
                                    else "fitted coop")
            else:
                best = min(estimated_time(c, layout, world, rows, hidden, ctas)
                           for c in (LARGE, WIDE, SMALL))
                assert t.consumers == 1 and not t.fitted
                assert estimated_time(t, layout, world, rows, hidden, ctas) == best
                picked[scaling].add((t.block_rows, t.block_cols))
            seg = segments(layout, world, rows, hidden=hidden, k=k, ctas=ctas, fitted=fitted,
                           fp8=scaling)
            assert seg.tiles == t
    assert len(picked["blocks"]) >= 4, picked
    assert {"fitted coop", "fitted coop wide"} <= picked["blocks"], picked
    assert picked["tensor"] == {1, 2, "fitted", "long K", "partial box"}, picked


def test_fp8_scaling_must_be_named():
    with pytest.raises(TokenWeaveInputError, match="fp8 must be one of"):
        tiles_for(Layout.REPLICATED, 2, 64, 4096, 1024, 132, fp8="rows")


def _fp8_emulation_worker(rank: int, world: int) -> list[tuple]:
    """Per case: (layout, rows, blocks, max |got - want| / max |want| of residual_out and
    normed), want: the reference op over this rank's dequantized partial sums."""
    import torch.distributed as dist

    group = dist.group.WORLD
    hidden, k = 256, 256
    comm = Communicator(group, 4 * 70, hidden, torch.float32, torch.device("cpu"), "reference")
    comm.prepare_gemm()
    results = []
    for layout, n, blocks in itertools.product((Layout.SEQUENCE_PARALLEL, Layout.REPLICATED),
                                               (1, 7, 70), (False, True)):
        sp = layout is Layout.SEQUENCE_PARALLEL
        chunks = world if sp else 1
        x, w, ops = _operands(chunks * n, hidden, k, blocks, 10 * rank + n)
        gen = torch.Generator().manual_seed(n)
        residual = torch.randn(chunks, n, hidden, generator=gen)[rank if sp else 0]
        norm = 1.0 + torch.randn(hidden, generator=gen)
        xf, wf = ops.dequantized(x, w)
        partial = (xf @ wf.t()).view(chunks, n, hidden)
        want_res, want_normed = torch.empty(n, hidden), torch.empty(chunks, n, hidden)
        fused_allreduce_rmsnorm_reference(partial, residual, norm, EPS, want_res, want_normed,
                                          layout, group)
        seg = segments(layout, world, n, hidden=hidden, k=k, ctas=1, fp8=ops.scaling,
                       chunk_stride=n if sp else 0)
        got_res = torch.full((n, hidden), float("nan"))
        normed = comm.normed[:chunks * n].view(chunks, n, hidden)
        normed.fill_(float("nan"))
        comm.row_gemm(x, w, None, seg, 0, ctas=1, fp8=ops)
        part = comm.partial[:chunks * n].view(chunks, n, hidden)
        comm.allreduce_rmsnorm(part, residual, norm, EPS, got_res, normed, layout, comm="gemm",
                               segments=seg, set_index=0)
        results.append((layout.value, n, blocks,
                        ((got_res - want_res).abs().max() / want_res.abs().max()).item(),
                        ((normed - want_normed).abs().max() / want_normed.abs().max()).item()))
    return results


@pytest.mark.parametrize("world", (2, 4))
def test_fp8_emulation_equals_the_reference(world):
    for rank_results in run_ranks(_fp8_emulation_worker, world=world):
        assert len(rank_results) == 12
        for *where, err_res, err_normed in rank_results:
            assert err_res <= 1e-5 and err_normed <= 1e-5, (where, err_res, err_normed)


def test_row_gemm_refuses_bad_fp8_operands(single_rank_group):
    comm = Communicator(single_rank_group, 64, 128, torch.float32, torch.device("cpu"),
                        "reference")
    comm.prepare_gemm()
    x, w, ops = _operands(8, 128, 128, True, 5)
    seg = segments(Layout.REPLICATED, 1, 8, hidden=128, k=128, ctas=1, fp8="blocks")
    with pytest.raises(TokenWeaveInputError, match="x scale_inv"):
        comm.row_gemm(x, w, None, seg, 0, ctas=1,
                      fp8=Fp8Operands(torch.ones(1, 4), ops.w_scale_inv, True))
    with pytest.raises(TokenWeaveInputError, match="or e4m3"):
        comm.row_gemm(x, w, None, seg, 0, ctas=1)


class _BlockQuantizer:
    """A stand-in for a TE linear's FP8 GEMM (fp8_gemm.Fp8Gemm.operands): its rows and weight
    quantized in TE's blockwise layouts (amax / 448 per 1 x 128 block of x, per 128 x 128 block
    of the weight); what it handed out is kept for the expectation."""

    def __init__(self, weight: torch.Tensor) -> None:
        n, k = weight.shape
        blocks = weight.view(-1, 128, k // 128, 128).abs().amax(dim=(1, 3)).clamp_min(1e-6) / 448
        self.w_scales = torch.zeros(-(-n // 128), -(-(k // 128) // 4) * 4)
        self.w_scales[:, :k // 128] = blocks
        per = blocks.repeat_interleave(128, 0).repeat_interleave(128, 1)
        self.w = (weight / per).to(FP8_DTYPE)
        self.handed: list[tuple[torch.Tensor, Fp8Operands]] = []

    def operands(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Fp8Operands]:
        n, k = rows.shape
        scales = rows.view(n, k // 128, 128).abs().amax(-1).clamp_min(1e-6) / 448  # [n, kb]
        x = (rows / scales.repeat_interleave(128, 1)).to(FP8_DTYPE)
        x_scales = torch.zeros(k // 128, -(-n // 4) * 4)
        x_scales[:, :n] = scales.t()
        ops = Fp8Operands(x_scales, self.w_scales, True)
        self.handed.append((x, ops))
        return x, self.w, ops


def _woven_fp8_worker(rank: int, world: int) -> list[float]:
    """The woven schedule's FP8 communicating GEMM (woven.WovenForward.row_gemm with the
    module's FP8 operands) on the emulation, split halves of 32 and 16 rows, each half's
    consumer after its GEMM: max |got - want| / max |want| of residual_out and normed against
    the reference op over the partial sums of the operands it handed out."""
    import torch.distributed as dist

    from megatron_tokenweave.policy import Plan
    from megatron_tokenweave.schedule import Half, SideStream
    from megatron_tokenweave.woven import WovenForward

    group, hidden, k, n = dist.group.WORLD, 256, 384, 48
    comm = Communicator(group, 64, hidden, torch.float32, torch.device("cpu"), "reference")
    comm.prepare_gemm()
    gen = torch.Generator().manual_seed(7 + rank)
    shared = torch.Generator().manual_seed(1)
    x = torch.randn(n, 1, hidden, generator=shared)  # the layer's input, every rank's
    norm = 1.0 + torch.randn(hidden, generator=shared)
    act = torch.randn(1, n, k, generator=gen)
    gemm = _BlockQuantizer(torch.randn(hidden, k, generator=gen) / k ** 0.5)
    halves = (Half(0, 32), Half(32, 16))
    plan = Plan(split=True, comm_ctas_attn=1, comm_ctas_mlp=1, comm_ctas_alone=1, comm="gemm")
    step = WovenForward(x, world, rank, False, comm, plan, halves, SideStream(x.device),
                        validate=True, fp8=True)
    residual = x.view(n, hidden)
    errors = []
    for i, half in enumerate(halves):
        step.row_gemm(i, act, half, torch.empty(0), None, gemm)
        rows = slice(half.offset, half.offset + half.rows)
        got_res = torch.full((half.rows, hidden), float("nan"))
        got_normed = torch.full((1, half.rows, hidden), float("nan"))
        comm.allreduce_rmsnorm(step.partials[i], residual[rows], norm, EPS, got_res, got_normed,
                               Layout.REPLICATED, comm="gemm", segments=step.gemm_segments[i],
                               set_index=i)
        xq, ops = gemm.handed[-1]
        xf, wf = ops.dequantized(xq, gemm.w)
        partial = (xf @ wf.t()).view(1, half.rows, hidden)
        want_res, want_normed = torch.empty(half.rows, hidden), torch.empty(1, half.rows, hidden)
        fused_allreduce_rmsnorm_reference(partial, residual[rows], norm, EPS, want_res,
                                          want_normed, Layout.REPLICATED, group)
        errors += [((got_res - want_res).abs().max() / want_res.abs().max()).item(),
                   ((got_normed - want_normed).abs().max() / want_normed.abs().max()).item()]
    return errors


def test_woven_fp8_communicating_gemm_equals_the_reference():
    """Both halves' rows (residual and normed) within fp32 rounding of the reference, on every
    rank; the segments the schedule made are FP8 ones over the quantized half alone."""
    for errors in run_ranks(_woven_fp8_worker, world=2):
        assert len(errors) == 4 and max(errors) <= 1e-5, errors


def _fit_waves_cost(extent: int, rows: int, hidden: int, ctas: int, cooperative: bool,
                    blocks: bool) -> tuple[int, int]:
    """(waves, waves x weight rows x (extent + FIT_TILE_COST)) of fitted tiles of `extent`
    tokens over a replicated call."""
    tile = fit_tile_rows(extent, cooperative, blocks)
    waves = -(-(-(-hidden // tile) * -(-rows // extent)) // ctas)
    return waves, waves * tile * (extent + FIT_TILE_COST)


@pytest.mark.parametrize("cooperative", [False, True])
def test_fitted_tiles_in_blocks_take_64_weight_rows_a_consumer_past_104_tokens(cooperative):
    """The fitted kernel's tiles in blocks (fit_gemm.cuh consumer_rows): 128 weight rows a
    consumer up to FIT_BLOCKS_HALVES_MAX_ROWS tokens, 64 past it up to FIT_WIDE_MAX_ROWS;
    per tensor and 16-bit 128 up to FIT_MAX_ROWS, 64 past it. fit_pick in blocks weighs a wave
    by its tiles' weight rows, so its extent is the one with the least waves x weight rows x
    (extent + FIT_TILE_COST) (the largest on ties) and, out of blocks, the same as by waves
    alone."""
    per = 2 if cooperative else 1
    for extent in range(FIT_MIN_ROWS, FIT_WIDE_MAX_ROWS + 1, 8):
        wide = extent > FIT_BLOCKS_HALVES_MAX_ROWS
        assert fit_tile_rows(extent, cooperative, blocks=True) == per * (64 if wide else 128)
        assert fit_tile_rows(extent, cooperative) == per * (64 if extent > FIT_MAX_ROWS else 128)
        t = fit_tiles(extent, cooperative, FP8_BLOCK_K, blocks=True)
        assert (t.block_rows, t.block_cols, t.fitted) == (extent, per * (64 if wide else 128), True)
    for rows, hidden, ctas, blocks in itertools.product(
            (1, 513, 1000, 4099, 8192, 16383), (4096, 5120, 8192), (8, 132), (False, True)):
        most = FIT_WIDE_MAX_ROWS if blocks else FIT_MAX_ROWS
        extents = range(FIT_MIN_ROWS, most + 1, 8)
        costs = {e: _fit_waves_cost(e, rows, hidden, ctas, cooperative, blocks) for e in extents}
        waves, extent = fit_pick(Layout.REPLICATED, 1, rows, hidden, ctas, cooperative, most,
                                 blocks)
        assert extent == min(extents, key=lambda e: (costs[e][1], -e))
        assert waves == costs[extent][0]
        if not blocks:  # one tile height: the same extent as waves x (extent + cost) alone
            assert extent == min(extents, key=lambda e: (costs[e][0] * (e + FIT_TILE_COST), -e))


@pytest.mark.parametrize("layout", [Layout.REPLICATED, Layout.SEQUENCE_PARALLEL])
def test_tokens_as_m_tiles(layout):
    """fit_tiles(tokens_m=True), e4m3 in blocks only: FIT_TOKENS_M_ROWS tokens a consumer (a
    tile of both consumers' cooperative), the extent the tiles' weight rows, one of
    FIT_TOKENS_M_EXTENTS; the geometry names that extent last (0 for the other layout) and
    counts the token tiles and the first one (segment rank + 1's) in tiles of 64 or 128."""
    world, rows, hidden = 4, 1031, 8192
    for extent, cooperative in itertools.product(FIT_TOKENS_M_EXTENTS, (False, True)):
        t = fit_tiles(extent, cooperative, FP8_BLOCK_K, blocks=True, tokens_m=True)
        tokens = FIT_TOKENS_M_ROWS * (2 if cooperative else 1)
        assert (t.block_rows, t.block_cols, t.block_k) == (tokens, extent, FP8_BLOCK_K)
        assert t.fitted and t.tokens_m and t.cooperative == cooperative and t.consumers == 2
        seg = segments(layout, world, rows, hidden=hidden, k=3696, ctas=132, tiles=t,
                       fp8="blocks")
        assert seg.release == "consumer"
        geo = seg.fitted_geometry(256, 2, 4000, world)
        assert len(geo) == 15 and geo[9:11] == [tokens, int(cooperative)] and geo[12] == extent
        if layout is Layout.SEQUENCE_PARALLEL:  # group 3's first tile
            assert geo[11] == 3 * -(-rows // tokens)
        else:  # the tile holding segment 3's first row
            assert geo[11] * tokens <= 3 * seg.rows < (geo[11] + 1) * tokens
    assert fit_tiles(104, True, FP8_BLOCK_K, blocks=True).tokens_m is False
    for extent, blocks in ((200, True), (256, True), (56, True), (128, False)):
        with pytest.raises(TokenWeaveInputError, match="tokens as M"):
            fit_tiles(extent, True, FP8_BLOCK_K, blocks=blocks, tokens_m=True)
