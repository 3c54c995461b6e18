"""The communicating row-parallel GEMM against cuBLAS and TransformerEngine's GEMM, on one GPU.

    python -m megatron_tokenweave.bench gemm_fused --out docs/results/gemm_fused_1gpu.json

Per model (every dense family's shapes by default), row-parallel GEMM (o_proj, fc2), TP size
(the rank's shard: K = in-features / TP), dtype and token count: `cublas` (torch.matmul into a
preallocated output), `te` (a TransformerEngine Linear of the same shard, where TE is
installed), `tokenweave` (the kernel ops/segments.tiles_for picks: a Triton kernel,
kernels/owner_gemm*.py, or on sm_90 the fitted CUDA kernel, csrc/include/tokenweave/
fit_gemm.cuh; its epilogue stores every row another rank owns into that rank's inbox; here the
TP-1 peers' inboxes are separate local allocations, GemmInbox.loopback, so the stores are all
paid, only the NVLink is not; operands in padded rows where theirs start off a 32-byte sector,
x's copy timed with the GEMM, as the layer does: ops/gemm_rows.py; `tokenweave_prepadded`
beside it, x padded ahead, outside the timed calls) and, where the fitted kernel runs, the
kernel the policy did not pick (`tokenweave_triton` or `tokenweave_fitted`); in FP8 per
tensor, where the Triton pick is the ping-pong kernel, the one-consumer kernel's best tiles
too (`tokenweave_one_consumer`); in FP8 blocks the fitted kernel in each mode at its own
extent to FIT_WIDE_MAX_ROWS as well, where that is not the pick (`tokenweave_fit<tokens>[c]`);
where the fitted kernel's cooperative mode runs (not in blocks), its tiles of 128-row consumers
(the narrow ones below where the pick's take 64-row consumers) in pairs of CTAs sharing each
weight tile's loads (`tokenweave_fit<tokens>c2`, never the pick), and split K
(`tokenweave_split_<region>`: ops/segments.split_k_tiles, beside its tiles without it,
`tokenweave_split_none`, and `tokenweave_split_fitted`: the part wave split of the fitted
tiles' own cooperative extent where that differs; never the pick);
not in blocks, the fitted tiles the pick rule gives with cooperative extents to FIT_MAX_ROWS
(`tokenweave_narrow`) and to FIT_WIDE_MAX_ROWS (`tokenweave_wide`: 64-row consumers past
FIT_MAX_ROWS), each where they are not the fitted tiles timed already.
`--breakdown` adds, per point, the Triton kernels with each release forced
(`tokenweave_release_gemm` / `_consumer`: the GEMM's CTAs fence and store flags after their
last tile, or the GEMM only stores tiles and its consumer publishes them, which costs the
consumer a flag store per rank, timed with the consumer on two GPUs), with each tile shape
forced (`tokenweave_tiles_<name>`), where the fitted kernel runs its tiles forced in both modes
at FIT_BREAKDOWN_ROWS tokens and at its model's extent per mode (`tokenweave_fit<tokens>[c]`;
not in blocks the cooperative ones in pairs too, `c2`),
and cuBLAS over the rows the picked tiles cover
(`cublas_covered`: the call's rows rounded up to whole row blocks per segment, or to whole
fitted tiles): whether a shortfall is the tile pick, the padded rows, or the kernel itself.
`--cutlass` adds `cutlass_<schedule>_<tile>_c<cluster>` rows (bench/cutlass_gemm.py: CUTLASS's
warp-specialized sm90 kernels, clusters of one CTA or of two sharing operand tiles through TMA
multicast), the plot a second row: per cluster shape, the best configuration's speed relative
to cuBLAS, median over the shards. Replicated layout (what Megatron's engines run), all SMs
(the unsplit case). Each impl is one CUDA graph of CALLS calls back to back on as many inputs
(a graph of a single call also times its replay's launch, microseconds beside GEMMs of 10-30
us); replays interleaved (bench/timing.py), medians per call. `--dtypes fp8 fp8_blocks`: e4m3
operands with bf16 rows, scaled per tensor (delayed and current scaling) or in TE's blockwise
recipe's blocks (1 x 128 of x, 128 x 128 of the weight): the communicating GEMM (the kernels' FP8
forms, ops/fp8_operands.py) against cuBLAS's FP8 GEMM
through torch._scaled_mm (`cublas` rows: fast accumulation per tensor, as TE's forward GEMMs;
cuBLAS's block-scaled form for blocks), the cuBLASLt GEMMs TE's FP8 Linear calls (no `te` rows in
FP8: te.Linear would add the quantization of x). `--passes N` times the same graphs N times (rows
carry `pass`): a 10-25 us GEMM's ratio moves by about 1 % from pass to pass (docs/kernel.md), so
the plot draws the median over passes and their range. Every communicating GEMM and CUTLASS row
is checked against cuBLAS before timing. The reduction that consumes the rows needs peers: its
timing is part of the 2-GPU kernel benchmark."""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable
from dataclasses import replace

import torch

from megatron_tokenweave.bench import add_sweep_arguments, command_parser
from megatron_tokenweave.bench.report import save_plot, write_result
from megatron_tokenweave.bench.split_cost import layer_gemms
from megatron_tokenweave.bench.timing import capture_graph, interleaved_medians
from megatron_tokenweave.models import SHAPES
from megatron_tokenweave.ops.fp8_operands import Fp8Operands
from megatron_tokenweave.ops.fp8_rows import BLOCK_COLS, FP8_DTYPE, scale_stride
from megatron_tokenweave.ops.gemm_rows import PaddedRows, needs_padding
from megatron_tokenweave.ops.segments import (
    FIT_MAX_ROWS,
    FIT_WIDE_MAX_ROWS,
    FP8_BLOCK_K,
    ONE_CONSUMER,
    RELEASES,
    SPLIT_REGIONS,
    TILES,
    fit_pick,
    fit_tiles,
    fits_long_k,
    fitted_tiles,
    one_consumer_tiles,
    segments,
    split_k_tiles,
)
from megatron_tokenweave.ops.validate import Layout

GEMMS = {"o_proj": "proj", "fc2": "fc2"}  # the result's name -> split_cost.layer_gemms's
FIT_BREAKDOWN_ROWS = (64, 96, 104, 128, 176, 208)  # --breakdown: fitted extents in both modes
CALLS = 10  # calls per timed graph
# 512-16K: powers of two, and counts that are odd, prime, or one past a tile
SWEEP = [512, 513, 641, 777, 1000, 1024, 1279, 1531, 2047, 2048, 2500, 3001, 3583, 4096, 4099,
         5003, 6143, 8191, 8192, 10007, 12289, 16383, 16384]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
FP8 = {"fp8": "tensor", "fp8_blocks": "blocks"}  # e4m3 operands (bf16 rows): their scaling
# Every dense family's shapes ("tiny" is a test shape; Mixtral's experts are Llama-3-8B's shards)
DENSE = [m for m, s in SHAPES.items() if not s.experts and s.hidden >= 1024]


def _te_linear(k: int, n: int, weight: torch.Tensor) -> Callable[[torch.Tensor], object] | None:
    """A TE Linear computing x @ weight^T, or None where TransformerEngine does not import."""
    try:
        import transformer_engine.pytorch as te
    except Exception:  # noqa: BLE001 - any TE import failure: no TE rows
        return None
    linear = te.Linear(k, n, bias=False, params_dtype=weight.dtype, device=weight.device)
    with torch.no_grad():
        linear.weight.copy_(weight)
    return linear


def _fp8_inputs(alloc: int, tokens: int, n: int, k: int, blocks: bool, dev: torch.device
                ) -> tuple[list[torch.Tensor], torch.Tensor, Fp8Operands]:
    """CALLS e4m3 inputs [alloc, K], an e4m3 weight [N, K] and their scales (per tensor, or
    TE's blocks for `tokens` rows): random values and random scales, the output of order one."""
    xs = [torch.randn(alloc, k, device=dev).to(FP8_DTYPE) for _ in range(CALLS)]
    w = torch.randn(n, k, device=dev).to(FP8_DTYPE)
    spread = Fp8Operands(torch.empty(0), torch.empty(0), blocks).shapes(tokens, n, k)
    x_s, w_s = (0.5 + torch.rand(shape, device=dev) for shape in spread)
    return xs, w, Fp8Operands(x_s, w_s * k**-0.5, blocks)


def _scaled_mm(w: torch.Tensor, ops: Fp8Operands, out: torch.Tensor,
               tokens: int) -> Callable[[torch.Tensor], object]:
    """cuBLAS's FP8 GEMM of x[:tokens] and w into `out`, scaled as `ops`. Blocks: over the
    first `cublas_rows(tokens)` rows of x and `out` (cuBLAS's block-scaled GEMM refuses a row
    count that is not a multiple of 4, and torch's scale_a must be exactly [rows, K/128]
    outer-dimension-major: at most 3 rows more than asked), scale_a [rows, K/128] and scale_b
    [K/128, N/128] outer-dimension-major copies of ops' scales without their padding, made
    once here (torch takes no other strides; `cublas_blocks_ok` says where cuBLAS then reads
    them right)."""
    if ops.blocks:
        kb = -(-w.shape[1] // BLOCK_COLS)
        rows = cublas_rows(tokens)
        a = ops.x_scale_inv[:, :rows].contiguous().t()
        b = ops.w_scale_inv[:, :kb].contiguous().t()
        return lambda x: torch._scaled_mm(x[:rows], w.t(), a, b, out_dtype=out.dtype,
                                          out=out[:rows])
    return lambda x: torch._scaled_mm(x[:tokens], w.t(), ops.x_scale_inv, ops.w_scale_inv,
                                      out_dtype=out.dtype, use_fast_accum=True, out=out[:tokens])


def cublas_blocks_ok(k: int) -> bool:
    """Whether cuBLAS's block-scaled FP8 GEMM, as torch._scaled_mm calls it, is a reference for
    K in-features: where K / 128 blocks is not a multiple of 4 torch takes only a scale_b stride
    of K/128 (not 16-byte aligned; a padded one it refuses), and there cuBLAS and the
    communicating GEMM disagreed by up to 205 (one H100, 2026-12-06, Llama-3-8B's fc2 at TP 8:
    K = 1792) where both matched the dequantized product elsewhere (docs/kernel.md)."""
    return -(-k // BLOCK_COLS) % 4 == 0


def cublas_rows(tokens: int) -> int:
    """The rows cuBLAS's block-scaled FP8 GEMM runs for `tokens`: the x scales' stride of rows
    (a multiple of 4), which the operands' scales are made with."""
    return scale_stride(tokens)


def measure(model: str, tp: int, tokens: int, iters: int, dtype: str = "bf16",
            cutlass: bool = False, passes: int = 1, breakdown: bool = False) -> list[dict]:
    """Rows of one (model, TP, tokens, dtype): every GEMM x impl x pass, in microseconds."""
    from megatron_tokenweave.kernels._ext import fitted_gemm_available
    from megatron_tokenweave.kernels.inbox import GemmInbox
    from megatron_tokenweave.kernels.owner_gemm import owner_gemm

    dev = torch.device("cuda")
    fp8 = FP8.get(dtype)  # None, or the scaling (ops/segments.FP8_SCALINGS)
    torch_dtype = torch.bfloat16 if fp8 else DTYPES[dtype]
    shape = SHAPES[model]
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    fitted = fitted_gemm_available(dev)
    max_rows = FIT_WIDE_MAX_ROWS if fp8 == "blocks" else FIT_MAX_ROWS
    long_k = fits_long_k(torch.cuda.get_device_name(dev))
    inbox = GemmInbox.loopback(tp, tokens, shape.hidden, torch_dtype, dev)
    rows = []
    for name, key in GEMMS.items():
        k, n = layer_gemms(shape, tp)[key]
        if fp8 == "blocks" and not cublas_blocks_ok(k):
            print(f"{model} TP={tp} {name}: K = {k}, no block-scaled cuBLAS reference "
                  "(cublas_blocks_ok); not measured")
            continue
        seg = segments(Layout.REPLICATED, tp, tokens, hidden=n, k=k, ctas=sms, fitted=fitted,
                       fp8=fp8, long_k=long_k)
        # The kernels the policy did not pick, timed beside the pick: the fitted one or the
        # Triton pick; in FP8 per tensor, where the Triton pick is the ping-pong kernel, the
        # one-consumer kernel's best tiles too; in blocks the fitted kernel's ping-pong mode.
        triton = segments(Layout.REPLICATED, tp, tokens, hidden=n, k=k, ctas=sms, fp8=fp8)
        other = {}
        if fitted:
            other = ({"tokenweave_triton": triton} if seg.tiles.fitted else
                     {"tokenweave_fitted": segments(
                         Layout.REPLICATED, tp, tokens, hidden=n, k=k, ctas=sms, tiles=replace(
                             fitted_tiles(Layout.REPLICATED, tp, tokens, n, sms),
                             block_k=triton.tiles.block_k))})
            if fp8 == "blocks":
                # the pick is cooperative (`blocks_tiles`): each mode at its own extent to
                # FIT_WIDE_MAX_ROWS as well, where that is not the pick
                for cooperative in (False, True):
                    tiles = fit_tiles(fit_pick(Layout.REPLICATED, tp, tokens, n, sms,
                                               cooperative, max_rows, blocks=True)[1],
                                      cooperative, FP8_BLOCK_K, True)
                    if tiles != seg.tiles:
                        other[f"tokenweave_{_tiles_name(tiles)}"] = segments(
                            Layout.REPLICATED, tp, tokens, hidden=n, k=k, ctas=sms, tiles=tiles)
        fit_seg = seg if seg.tiles.fitted else other.get("tokenweave_fitted")
        if fit_seg is not None and fp8 != "blocks":
            # the fitted tiles with cooperative extents to FIT_MAX_ROWS (128-row consumers) and
            # to FIT_WIDE_MAX_ROWS (64-row ones past it), whichever the pick rule did not take
            for bound, most in (("narrow", FIT_MAX_ROWS), ("wide", FIT_WIDE_MAX_ROWS)):
                tiles = replace(fitted_tiles(Layout.REPLICATED, tp, tokens, n, sms, most),
                                block_k=triton.tiles.block_k)
                if tiles != fit_seg.tiles:
                    other[f"tokenweave_{bound}"] = segments(
                        Layout.REPLICATED, tp, tokens, hidden=n, k=k, ctas=sms, tiles=tiles)
            # its cooperative tiles of 128-row consumers (the narrow ones where those of the
            # pick rule take 64-row ones) in pairs of CTAs (never the pick)
            coop = fit_seg.tiles if fit_seg.tiles.block_rows <= FIT_MAX_ROWS else other.get(
                "tokenweave_narrow", fit_seg).tiles
            if coop.cooperative and coop.block_rows <= FIT_MAX_ROWS:
                pair = replace(coop, pair=True)
                other[f"tokenweave_{_tiles_name(pair)}"] = segments(
                    Layout.REPLICATED, tp, tokens, hidden=n, k=k, ctas=sms, tiles=pair)
            # split K in each region, and its tiles without it (never the pick; none where
            # every wave is full, in any region)
            for region in SPLIT_REGIONS:
                tiles = split_k_tiles(Layout.REPLICATED, tp, tokens, n, k, sms,
                                      triton.tiles.block_k, region)
                if tiles is not None:
                    other[f"tokenweave_split_{region}"] = segments(
                        Layout.REPLICATED, tp, tokens, hidden=n, k=k, ctas=sms, tiles=tiles)
            if tiles is not None:
                other["tokenweave_split_none"] = segments(
                    Layout.REPLICATED, tp, tokens, hidden=n, k=k, ctas=sms,
                    tiles=replace(tiles, split_tiles=0, split_steps=0))
            # split K's part wave of the fitted tiles' own cooperative extent, where that is
            # not the area-best one (never the pick)
            own = fit_seg.tiles
            tiles = (split_k_tiles(Layout.REPLICATED, tp, tokens, n, k, sms, own.block_k,
                                   extent=own.block_rows)
                     if own.cooperative and not own.pair and not own.split_tiles else None)
            none = other.get("tokenweave_split_none")
            if tiles is not None and (none is None or none.tiles.block_rows != tiles.block_rows):
                other["tokenweave_split_fitted"] = segments(
                    Layout.REPLICATED, tp, tokens, hidden=n, k=k, ctas=sms, tiles=tiles)
        if fp8 == "tensor" and triton.tiles.consumers == 2:
            other["tokenweave_one_consumer"] = segments(
                Layout.REPLICATED, tp, tokens, hidden=n, k=k, ctas=sms, tiles=replace(
                    one_consumer_tiles(Layout.REPLICATED, tp, tokens, n, sms),
                    block_k=FP8_BLOCK_K))
        forced = {}
        if breakdown:
            forced = {f"tokenweave_release_{r}": replace(triton, release=r) for r in RELEASES}
            shapes = TILES if fp8 is None else {
                t: replace(tiles, block_k=FP8_BLOCK_K) for t, tiles in TILES.items()
                if fp8 == "tensor" or tiles in ONE_CONSUMER}
            forced.update({f"tokenweave_tiles_{t}": segments(
                Layout.REPLICATED, tp, tokens, hidden=n, k=k, ctas=sms, tiles=tiles)
                for t, tiles in shapes.items()})
            if fitted:
                forced.update({f"tokenweave_{_tiles_name(tiles)}": segments(
                    Layout.REPLICATED, tp, tokens, hidden=n, k=k, ctas=sms, tiles=tiles)
                    for tiles in _fitted_variants(tokens, n, sms, triton.tiles.block_k,
                                                  max_rows, fp8 == "blocks")})
        covered = _covered(seg, tp)
        alloc = max(covered, cublas_rows(tokens) if fp8 == "blocks" else tokens)
        out = torch.empty(alloc, n, device=dev, dtype=torch_dtype)
        if fp8 is not None:
            xs, w, ops = _fp8_inputs(alloc, tokens, n, k, fp8 == "blocks", dev)
            impls = {"cublas": _scaled_mm(w, ops, out, tokens)}
        else:
            xs = [torch.randn(alloc, k, device=dev, dtype=torch_dtype)
                  for _ in range(CALLS)]
            w = torch.randn(n, k, device=dev, dtype=torch_dtype) / k**0.5
            ops = None
            impls = {"cublas": lambda x, w=w, out=out: torch.matmul(x[:tokens], w.t(),
                                                                   out=out[:tokens])}
        # Operands as the layer hands them over (ops/gemm_rows.py): x copied into padded rows
        # per call where its rows start off a sector (the copy timed), the weight once.
        x_rows, w_in = PaddedRows(), PaddedRows()(w)
        picks = {"tokenweave": seg, **other, **forced}
        impls.update({impl: lambda x, w=w_in, s=s, ops=ops, rows=x_rows: owner_gemm(
            rows(x[:tokens]), w, None, inbox, s, 0, sms, 1, fp8=ops)
                      for impl, s in picks.items()})
        if needs_padding(xs[0][:tokens]):
            # the pick on x padded ahead, outside the timed calls: what the copy costs
            ahead = {x.data_ptr(): PaddedRows()(x[:tokens]) for x in xs}
            impls["tokenweave_prepadded"] = lambda x, w=w_in, s=seg, ops=ops, a=ahead: owner_gemm(
                a[x.data_ptr()], w, None, inbox, s, 0, sms, 1, fp8=ops)
            picks["tokenweave_prepadded"] = seg
        if breakdown and fp8 is None:
            impls["cublas_covered"] = lambda x, w=w, o=out[:covered]: torch.matmul(
                x[:o.shape[0]], w.t(), out=o)
        te = None if fp8 is not None else _te_linear(k, n, w)
        if te is not None:
            impls["te"] = lambda x, te=te: te(x[:tokens])
        if cutlass:
            impls.update(_cutlass_impls(w, out[:tokens], tokens))
        _check(impls, inbox, picks, xs[0], out[:tokens])
        with torch.no_grad():
            graphs = {impl: capture_graph(lambda fn=fn, xs=xs: [fn(x) for x in xs])
                      for impl, fn in impls.items()}
        for p in range(passes):
            us = interleaved_medians({i: (lambda _, g=g: g.replay()) for i, g in graphs.items()},
                                     iters=iters)
            rows += [{"model": model, "gemm": name, "tp": tp, "tokens": tokens, "dtype": dtype,
                      "impl": impl, "us": round(t / CALLS, 2), "pass": p,
                      "tiles": _tiles_name(seg.tiles)} for impl, t in us.items()]
    inbox.close()
    return rows


def _fitted_variants(tokens: int, hidden: int, ctas: int, block_k: int, max_rows: int,
                     blocks: bool) -> list:
    """The fitted kernel's tiles in both modes at FIT_BREAKDOWN_ROWS tokens (up to max_rows,
    cooperative ones to FIT_WIDE_MAX_ROWS) and at the extent its model picks per mode
    (ops/segments.fit_pick), and, not in blocks, the cooperative ones of at most FIT_MAX_ROWS
    in pairs of CTAs too: whether a shortfall is the pick's extent or mode, or the kernel at
    any extent."""
    most = {False: max_rows, True: FIT_WIDE_MAX_ROWS}
    rows = {cooperative: sorted({*(r for r in FIT_BREAKDOWN_ROWS if r <= most[cooperative]),
                                 fit_pick(Layout.REPLICATED, 1, tokens, hidden, ctas, cooperative,
                                          most[cooperative], blocks)[1]})
            for cooperative in (False, True)}
    pairs = [] if blocks else [fit_tiles(r, True, block_k, pair=True) for r in rows[True]
                               if r <= FIT_MAX_ROWS]
    return [fit_tiles(r, c, block_k, blocks) for c, extents in rows.items()
            for r in extents] + pairs


def _covered(seg, world: int) -> int:
    """Rows the picked tiles compute: the call's rows rounded up to whole row blocks per segment
    (Triton kernels), or to whole tiles (the fitted kernel: one run of every segment's rows)."""
    if seg.tiles.fitted:
        return -(-seg.total // seg.tiles.block_rows) * seg.tiles.block_rows
    return seg.nonempty_blocks(world) * seg.tiles.block_rows


def _tiles_name(tiles) -> str:
    """The Triton tiles' name (TILES; FP8's have deeper K blocks), or the fitted kernel's:
    fit<tokens>, c if cooperative, c2 if in pairs of CTAs."""
    if tiles.fitted:
        mode = "c2" if tiles.pair else "c" if tiles.cooperative else ""
        return f"fit{tiles.block_rows}{mode}"
    return next(name for name, t in TILES.items() if replace(t, block_k=tiles.block_k) == tiles)


def _cutlass_impls(w: torch.Tensor, out: torch.Tensor, tokens: int) -> dict[str, Callable]:
    from megatron_tokenweave.bench import cutlass_gemm

    return {f"cutlass_{name}": lambda x, f=cutlass_gemm.gemm(name), w=w, out=out: f(x[:tokens],
                                                                                    w, out)
            for name in cutlass_gemm.CONFIGS}


def _check(impls: dict, inbox, segs: dict, x: torch.Tensor, out: torch.Tensor) -> None:
    """Every communicating GEMM's tiles (`segs`: its segments by impl), in every owner's slot of
    rank 0 (poisoned first), and every CUTLASS configuration's output equal cuBLAS's rows."""
    impls["cublas"](x)
    want = out.clone()
    for impl in (i for i in impls if i.startswith("cutlass_")):
        out.fill_(float("nan"))
        impls[impl](x)
        torch.cuda.synchronize()
        torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2,
                                   msg=lambda m, impl=impl: f"{impl}: {m}")
    out.copy_(want)
    for impl, seg in segs.items():
        for slots in inbox.owner_slots:
            slots.fill_(float("nan"))
        impls[impl](x)
        torch.cuda.synchronize()
        for c, slots in enumerate(inbox.owner_slots):
            n = seg.length(c)
            got = slots[0, seg.row0:seg.row0 + n].float()
            torch.testing.assert_close(got, out[c * seg.rows:c * seg.rows + n].float(),
                                       rtol=2e-2, atol=2e-2,
                                       msg=lambda m, impl=impl, c=c: f"{impl}, owner {c}: {m}")


def _plot(result: dict, path: str) -> None:
    """Per dtype (rows) and model (columns): cuBLAS time / ours against token count, one line
    per shard (GEMM, TP), the median over passes and their range; with CUTLASS rows a last row
    of its best configuration per cluster shape."""
    import statistics

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    if not rows:
        return  # nothing measured (every shard of the call without a reference)
    by = {(r["model"], r["gemm"], r["tp"], r["tokens"], r.get("dtype", "bf16"), r["impl"],
           r.get("pass", 0)): r["us"] for r in rows}
    passes = sorted({r.get("pass", 0) for r in rows})
    models = list(dict.fromkeys(r["model"] for r in rows))
    dtypes = list(dict.fromkeys(r.get("dtype", "bf16") for r in rows))
    clusters = sorted({r["impl"].rsplit("_", 1)[1] for r in rows
                       if r["impl"].startswith("cutlass_")})
    grid = len(dtypes) + bool(clusters)
    fig, axes = plt.subplots(grid, len(models), figsize=(5.5 * len(models), 4 * grid),
                             squeeze=False)
    for ax_row, dtype in zip(axes, dtypes, strict=False):
        for ax, model in zip(ax_row, models, strict=True):
            mine = [r for r in rows if r["model"] == model and r.get("dtype", "bf16") == dtype]
            if not mine:
                ax.set_visible(False)  # a joined file without this model in this dtype
                continue
            lengths = sorted({r["tokens"] for r in mine})
            for gemm in GEMMS:
                for tp in sorted({r["tp"] for r in mine if r["gemm"] == gemm}):
                    ratios = [[by[(model, gemm, tp, t, dtype, "cublas", p)]
                               / by[(model, gemm, tp, t, dtype, "tokenweave", p)]
                               for p in passes] for t in lengths]
                    mid = [statistics.median(r) for r in ratios]
                    spread = [[m - min(r) for m, r in zip(mid, ratios, strict=True)],
                              [max(r) - m for m, r in zip(mid, ratios, strict=True)]]
                    ax.errorbar(lengths, mid, yerr=spread, marker=".", capsize=2, lw=0.9,
                                label=f"{gemm} TP={tp}")
            ax.set_ylabel("cuBLAS time / communicating GEMM time"
                          + (f"\n(median; bars: range of {len(passes)} passes)"
                             if len(passes) > 1 else ""))
            ax.set_title(f"{model} {dtype}: row-parallel shards, {result['gpu']}", fontsize=9)
    for ax, model in zip(axes[-1], models, strict=True) if clusters else ():
        lengths = sorted({r["tokens"] for r in rows if r["model"] == model})
        shards = sorted({(r["gemm"], r["tp"]) for r in rows if r["model"] == model})

        def median_ratio(impls, t, model=model, shards=shards):
            """cuBLAS time / the fastest of `impls`, median over shards and passes."""
            return statistics.median(
                by[(model, g, tp, t, dtypes[0], "cublas", p)]
                / min(by[(model, g, tp, t, dtypes[0], i, p)] for i in impls)
                for g, tp in shards for p in passes)

        for cluster in clusters:
            impls = {r["impl"] for r in rows if r["impl"].endswith("_" + cluster)}
            ax.plot(lengths, [median_ratio(impls, t) for t in lengths], marker="o",
                    label=f"CUTLASS, best of cluster {cluster[1:]}")
        ax.plot(lengths, [median_ratio(["tokenweave"], t) for t in lengths], marker="s",
                color="black", label="tokenweave")
        ax.set_ylabel("cuBLAS time / GEMM time (median over shards)")
        ax.set_title(f"{model}: CUTLASS cluster shapes", fontsize=9)
    for ax in (a for a in axes.flat if a.get_visible()):
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.axhline(0.98, color="red", lw=0.6, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens")
        ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    save_plot(fig, path, dpi=100)


def _summary(us: dict) -> str:
    """One line of ratios to cuBLAS per GEMM: ours as picked, TE's, each release (and, with
    --breakdown, each tile shape and cuBLAS over the covered rows) forced, and CUTLASS's best
    configuration where timed."""
    def ratio(g, impl):
        return us[(g, "cublas")] / us[(g, impl)]

    return ", ".join(
        f"{g} cublas/tokenweave {ratio(g, 'tokenweave'):.3f}"
        + (f" te/tokenweave {us[(g, 'te')] / us[(g, 'tokenweave')]:.3f}" if (g, "te") in us
           else "")
        + " (" + " ".join(f"{i.removeprefix('tokenweave_')} {ratio(g, i):.3f}"
                          for (h, i) in us if h == g and i.startswith(("tokenweave_", "cublas_")))
        + ")" + _best_cutlass(us, g)
        for g in GEMMS if (g, "cublas") in us)


def _best_cutlass(us: dict, gemm: str) -> str:
    """' cutlass <best configuration> <cuBLAS / its time>', or '' without CUTLASS rows."""
    mine = {i: t for (g, i), t in us.items() if g == gemm and i.startswith("cutlass_")}
    if not mine:
        return ""
    best = min(mine, key=mine.get)
    return f" {best} {us[(gemm, 'cublas')] / mine[best]:.3f}"


def parser() -> argparse.ArgumentParser:
    parser = command_parser("gemm_fused", __doc__)
    parser.add_argument("--models", nargs="+", default=DENSE, choices=DENSE, metavar="MODEL",
                        help=f"dense model shapes, of {', '.join(DENSE)}")
    parser.add_argument("--tp", nargs="+", type=int, default=[2, 4, 8],
                        help="tensor-parallel sizes whose shards are timed")
    parser.add_argument("--cutlass", action="store_true",
                        help="also time CUTLASS's sm90 kernels (bench/cutlass_gemm.py; needs the "
                             "nvidia-cutlass package, builds on first use)")
    parser.add_argument("--dtypes", nargs="+", default=["bf16"], choices=sorted(DTYPES | FP8),
                        help="GEMM dtypes")
    parser.add_argument("--breakdown", action="store_true",
                        help="also time the Triton kernels with each tile shape and release "
                             "forced, the fitted kernel at several extents in both modes, and "
                             "cuBLAS over the covered rows")
    parser.add_argument("--passes", type=int, default=1,
                        help="times the same graphs are timed (rows carry `pass`; the spread)")
    add_sweep_arguments(parser, tokens=SWEEP, iters=30, timed="impl",
                        out="docs/results/gemm_fused_1gpu.json")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the GEMM-fused benchmark needs a GPU")
    if args.cutlass:
        from megatron_tokenweave.bench import cutlass_gemm

        try:
            cutlass_gemm.load()
        except cutlass_gemm.CutlassUnavailableError as exc:
            raise SystemExit(f"--cutlass: {exc}") from exc
    rows = []
    for model in args.models:
        for tp, dtype, tokens in itertools.product(args.tp, args.dtypes, args.tokens):
            got = measure(model, tp, tokens, args.iters, dtype, args.cutlass, args.passes,
                          args.breakdown)
            rows += got
            for p in range(args.passes if got else 0):
                us = {(r["gemm"], r["impl"]): r["us"] for r in got if r["pass"] == p}
                label = f" pass {p}" if args.passes > 1 else ""
                print(f"{model} TP={tp} {dtype} {tokens:5d} tokens{label} ({got[0]['tiles']}): "
                      f"{_summary(us)}", flush=True)
    write_result("gemm_fused", argv, rows, args.out, _plot)


if __name__ == "__main__":
    main()
