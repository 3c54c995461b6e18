"""The fused op writing its normed rows in FP8 (ops.fp8_rows) against the op alone (rows in
bf16), the op followed by TransformerEngine's quantizer (what the woven layer does without
it), and TE's own norm + quantize of the same rows (LayerNormLinear's prologue, no reduction),
for 1 x 128 block scales and one known scale, replicated layout, one GPU. Without
TransformerEngine the two TE rows are left out (None).

    python -m megatron_tokenweave.bench fp8_rows --out docs/results/fp8_rows_1gpu.json

One process: the TP ranks are P communicators over P allocations of this GPU (call_check's
LoopbackRanks), and one timed unit is a CUDA graph in which every rank's CALLS calls run on a
stream of its own, so the ranks' kernels run at the same time and exchange through device
memory: the local part of the op (its reads, math and stores; no NVLink). Before timing, every
rank's FP8 rows are checked bit for bit against the reference quantization of its bf16 rows.
Medians of interleaved replays (bench.timing). Where the two-shot path runs (TP >= 4), which
writes y back into the partial, every op restores its partial first; the restores alone are
timed as well and subtracted.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable

import torch

from megatron_tokenweave.bench import command_parser
from megatron_tokenweave.bench.call_check import LoopbackRanks
from megatron_tokenweave.bench.report import save_plot, write_result
from megatron_tokenweave.ops.fp8_rows import FP8_DTYPE, Fp8Rows, scale_stride
from megatron_tokenweave.ops.validate import Layout

CALLS = 10  # calls per rank in one timed graph
EPS = 1e-5
SCALINGS = ("blocks", "tensor")


# What the fused op writes for the next linear per woven TE recipe (e4m3): delayed scaling's one
# known scale, blockwise's 1 x 128 blocks. Tensorwise (current scaling) is absent: its scale is
# the amax of the whole call, which a one-pass op cannot know before its first row.
RECIPE_SCALING = {"delayed": "tensor", "blockwise": "blocks"}


def te_quantizer(scaling: str, dev: torch.device):
    """TE's rowwise e4m3 quantizer of a scaling ("blocks", "tensor": a known scale of 2, or
    "current": tensorwise current scaling), or None where TransformerEngine does not import."""
    try:
        from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer  # noqa: I001
        from transformer_engine.pytorch.tensor.float8_tensor import (
            Float8CurrentScalingQuantizer,
            Float8Quantizer,
        )

        import transformer_engine_torch as tex  # after TE's package, which loads its library
    except Exception:  # noqa: BLE001 - any TE import failure: no TE rows
        return None
    e4m3 = tex.DType.kFloat8E4M3
    if scaling == "blocks":
        return Float8BlockQuantizer(e4m3, rowwise=True, columnwise=False, block_scaling_dim=1)
    if scaling == "current":
        return Float8CurrentScalingQuantizer(e4m3, device=dev, rowwise=True, columnwise=False)
    return Float8Quantizer(torch.tensor([2.0], device=dev), torch.zeros(1, device=dev), e4m3,
                           rowwise=True, columnwise=False)


def fp8_rows_for(scaling: str, tokens: int, hidden: int, dev: torch.device) -> Fp8Rows:
    """Where the op writes `tokens` FP8 rows of this scaling ("blocks" or "tensor": scale 2)."""
    data = torch.empty(1, tokens, hidden, dtype=FP8_DTYPE, device=dev)
    if scaling == "blocks":
        return Fp8Rows.blockwise(data, torch.empty(hidden // 128, scale_stride(tokens),
                                                   device=dev))
    return Fp8Rows.tensor_scaled(data, torch.tensor([2.0], device=dev),
                                 torch.zeros(1, device=dev), torch.empty(1, device=dev))


def _graph(streams: list[torch.cuda.Stream],
           per_rank: Callable[[int, int], None]) -> torch.cuda.CUDAGraph:
    """One replay: per_rank(r, c) for every rank's CALLS calls on its own stream, all forked
    before any joins (call_check's arrangement)."""
    graph = torch.cuda.CUDAGraph()
    main = torch.cuda.Stream()
    with torch.cuda.graph(graph, stream=main):
        for stream in streams:
            stream.wait_stream(main)
        for r, stream in enumerate(streams):
            with torch.cuda.stream(stream):
                for c in range(CALLS):
                    per_rank(r, c)
        for stream in streams:
            main.wait_stream(stream)
    return graph


def _measure(world: int, tokens: int, hidden: int, ctas: int, iters: int) -> list[dict]:
    from megatron_tokenweave.bench.timing import interleaved_medians
    from megatron_tokenweave.kernels import KernelComm, twoshot_applies

    dev, dtype = torch.device("cuda", 0), torch.bfloat16
    ranks = LoopbackRanks(world, tokens * hidden * 2 + 4096, dev)
    parts = [d[:tokens * hidden * 2].view(dtype).view(1, tokens, hidden).normal_()
             for d in ranks.data]
    residual = torch.randn(tokens, hidden, device=dev, dtype=dtype)
    weight = (1 + 0.1 * torch.randn(hidden, device=dev)).to(dtype)
    outs = [torch.empty(tokens, hidden, device=dev, dtype=dtype) for _ in range(world)]
    normeds = [torch.empty(1, tokens, hidden, device=dev, dtype=dtype) for _ in range(world)]
    comms = [KernelComm(r) for r in ranks.ranks]
    streams = [torch.cuda.Stream() for _ in range(world)]
    fp8 = {s: [fp8_rows_for(s, tokens, hidden, dev) for _ in range(world)] for s in SCALINGS}
    quantizers = {s: te_quantizer(s, dev) for s in SCALINGS}

    # The two-shot path (TP >= 4) writes y back into the partial: every op then restores its
    # rank's partial first, and the copies alone are timed too and taken off.
    clobbers = twoshot_applies(Layout.REPLICATED, world, tokens, hidden, 2)
    saved = [p.clone() for p in parts] if clobbers else []

    def restore(r: int, _: int = 0) -> None:
        if clobbers:
            parts[r].copy_(saved[r])

    def op(r: int, c: int, normed) -> None:
        restore(r)
        comms[r].run(parts[r], residual, weight, EPS, outs[r], normed, Layout.REPLICATED,
                     ctas=ctas, call=c, validate=False)

    units = {"op": lambda r, c: op(r, c, normeds[r])}
    if clobbers:
        units["restore"] = restore
    te = all(q is not None for q in quantizers.values())
    for s in SCALINGS:
        units[f"fused_{s}"] = lambda r, c, s=s: op(r, c, fp8[s][r])
    if te:
        from transformer_engine.pytorch.module._common import apply_normalization

        for s in SCALINGS:
            units[f"separate_{s}"] = lambda r, c, s=s: (op(r, c, normeds[r]),
                                                        quantizers[s](normeds[r][0]))
            units[f"te_norm_{s}"] = lambda r, c, s=s: apply_normalization(
                outs[r], None, weight, None, EPS, quantizers[s], dtype, "RMSNorm", 0, False)
        for s in SCALINGS:  # TE's pieces eagerly once (the ops only run with every rank at once)
            quantizers[s](normeds[0][0])
            apply_normalization(outs[0], None, weight, None, EPS, quantizers[s], dtype,
                                "RMSNorm", 0, False)
    torch.cuda.synchronize()
    graphs = {name: _graph(streams, unit) for name, unit in units.items()}
    _check(graphs, fp8, normeds, ranks)
    medians = interleaved_medians({n: lambda _, g=g: g.replay() for n, g in graphs.items()},
                                  iters=iters)
    for comm in comms:
        comm.close()
    del graphs
    torch.cuda.synchronize()
    ranks.close()
    rows = []
    copies = medians.get("restore", 0.0)
    for s in SCALINGS:
        op_us, fused_us = (medians["op"] - copies) / CALLS, (medians[f"fused_{s}"] - copies) / CALLS
        separate_us = (medians[f"separate_{s}"] - copies) / CALLS if te else None
        te_us = medians[f"te_norm_{s}"] / CALLS if te else None
        rows.append(dict(tp=world, tokens=tokens, hidden=hidden, scaling=s, ctas=ctas,
                         op_us=op_us, fused_us=fused_us, separate_us=separate_us,
                         te_norm_quantize_us=te_us, cost=fused_us / op_us - 1.0,
                         vs_separate=fused_us / separate_us if te else None))
    return rows


def _check(graphs: dict, fp8: dict, normeds: list, ranks: LoopbackRanks) -> None:
    """Every rank's FP8 rows equal, bit for bit, the reference quantization of its bf16 rows
    (every call of a replay on the same inputs)."""
    graphs["op"].replay()
    for rows in fp8.values():
        for r in rows:
            r.data.view(torch.uint8).fill_(0x7F)
    for s in SCALINGS:
        graphs[f"fused_{s}"].replay()
    torch.cuda.synchronize()
    for s, per_rank in fp8.items():
        for r, rows in enumerate(per_rank):
            ref = Fp8Rows(torch.empty_like(rows.data), rows.scale_inv.clone(), rows.scale,
                          None if rows.blocks else rows.amax.clone(), rows.amax_eps, rows.pow2)
            ref.quantize(normeds[r][0])
            if not torch.equal(ref.data.view(torch.uint8), rows.data.view(torch.uint8)):
                raise RuntimeError(f"rank {r}: FP8 rows ({s}) differ from the reference "
                                   f"quantization ({ranks.describe_errors()})")


def _plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(SCALINGS), figsize=(12, 4), sharey=True)
    keys = sorted({(r["tp"], r["hidden"]) for r in result["rows"]})
    for ax, scaling in zip(axes, SCALINGS, strict=True):
        for tp, hidden in keys:
            rows = sorted((r for r in result["rows"] if (r["tp"], r["hidden"], r["scaling"])
                           == (tp, hidden, scaling)), key=lambda r: r["tokens"])
            x = [r["tokens"] for r in rows]
            line, = ax.plot(x, [r["fused_us"] / r["op_us"] for r in rows], marker="o",
                            label=f"TP {tp}, H {hidden}: op writing FP8")
            if all(r["separate_us"] is not None for r in rows):
                ax.plot(x, [r["separate_us"] / r["op_us"] for r in rows], marker="x", ls="--",
                        color=line.get_color(), label=f"TP {tp}, H {hidden}: op + TE quantize")
        ax.axhline(1.03, color="grey", ls=":", lw=1, label="goal: op + 3 %")
        ax.axhline(1.0, color="black", lw=0.5)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens (replicated layout)")
        ax.set_title(f"{scaling} scaling")
    axes[0].set_ylabel("time / the op writing bf16 rows")
    axes[-1].legend(fontsize=7)
    fig.suptitle(f"FP8 normed rows, local part, {result['gpu']} ({result['date']})")
    fig.tight_layout()
    save_plot(fig, path, dpi=120)


def parser() -> argparse.ArgumentParser:
    parser = command_parser("fp8_rows", __doc__)
    parser.add_argument("--tp", nargs="+", type=int, default=[2, 4],
                        help="TP sizes (ranks on this GPU)")
    parser.add_argument("--tokens", nargs="+", type=int,
                        default=[1024, 2048, 3001, 4096, 8192], help="tokens of a call")
    parser.add_argument("--hidden", nargs="+", type=int, default=[4096, 8192],
                        help="hidden sizes (multiples of 128)")
    parser.add_argument("--ctas", type=int, default=16, help="CTAs of each rank's op")
    parser.add_argument("--iters", type=int, default=30, help="timed replays (interleaved)")
    parser.add_argument("--out", default="docs/results/fp8_rows_1gpu.json",
                        help="result JSON (plot beside it)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    bad = [h for h in args.hidden if h % 128]
    if bad:
        raise SystemExit(f"--hidden {bad}: 1 x 128 block scales need multiples of 128")
    rows = []
    for world, hidden, tokens in itertools.product(args.tp, args.hidden, args.tokens):
        for row in _measure(world, tokens, hidden, args.ctas, args.iters):
            te = "" if row["separate_us"] is None else (
                f", op + TE quantize {row['separate_us']:.1f} us, TE norm + quantize "
                f"{row['te_norm_quantize_us']:.1f} us")
            print(f"TP {world} H {hidden} tokens {tokens} {row['scaling']}: op "
                  f"{row['op_us']:.1f} us, op writing FP8 {row['fused_us']:.1f} us "
                  f"({100 * row['cost']:+.1f} %){te}", flush=True)
            rows.append(row)
    write_result("fp8_rows", argv, rows, args.out, _plot)


if __name__ == "__main__":
    main()
