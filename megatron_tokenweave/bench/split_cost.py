"""What splitting the tokens costs before any communication, on one GPU.

    python -m megatron_tokenweave.bench split_cost --out docs/results/split_cost.json

The woven layer runs each tensor-parallel GEMM of a layer (qkv, proj, fc1, fc2 of `--model` at
`--tp`: this rank's shard) on the two halves of the tokens instead of once on all of them
(attention stays whole). Even with every all-reduce hidden, a woven block can then be no faster
than the stock block without communication (`te_nocomm`) times (whole / halves) of these GEMMs;
this measures that factor: per token count T, the layer's four GEMMs on T rows vs on T/2 + T - T/2
rows, each plan one CUDA graph, replays interleaved (bench/timing.py), bf16, torch's cuBLAS.

With `--fp8-recipe R ...` (TE needed) the GEMMs are TE linears' FP8 GEMMs in each recipe R (e4m3)
as the woven linears run them (megatron_tokenweave.fp8_gemm: each half's input quantized, then
TE's GEMM into its rows), whole and as halves, beside the bf16 whole plan (`bf16_whole_us`):
what a woven FP8 layer's GEMMs cost against the bf16 ones on one GPU. Every row says its
`precision`.
"""

from __future__ import annotations

import argparse
import contextlib

import torch

from megatron_tokenweave.bench import add_model_argument, add_sweep_arguments, command_parser
from megatron_tokenweave.bench.report import grouped_bars, save_plot, write_result
from megatron_tokenweave.bench.timing import capture_graph, interleaved_medians
from megatron_tokenweave.models import SHAPES, Shape
from megatron_tokenweave.precision import bench_precision


def layer_gemms(shape: Shape, tp: int) -> dict[str, tuple[int, int]]:
    """(in, out) features of one rank's shard of each GEMM of a dense layer."""
    head_dim = shape.hidden // shape.heads
    qkv = (shape.hidden + 2 * shape.kv_groups * head_dim) // tp
    return {"qkv": (shape.hidden, qkv), "proj": (shape.hidden // tp, shape.hidden),
            "fc1": (shape.hidden, 2 * shape.ffn // tp), "fc2": (shape.ffn // tp, shape.hidden)}


def _te_recipe(name: str):
    """TE's recipe object of a Megatron recipe name, e4m3."""
    from transformer_engine.common import recipe

    fmt = recipe.Format.E4M3
    return {"delayed": lambda: recipe.DelayedScaling(fp8_format=fmt),
            "tensorwise": lambda: recipe.Float8CurrentScaling(fp8_format=fmt),
            "blockwise": lambda: recipe.Float8BlockScaling(fp8_format=fmt)}[name]()


def measure(shape: Shape, tp: int, tokens: int, iters: int, fp8_recipe: str = "none") -> list[dict]:
    """Rows of whole / halves microseconds, per GEMM and for the layer's four together (FP8:
    and the bf16 whole plan's)."""
    dev, dtype = torch.device("cuda"), torch.bfloat16
    gemms = layer_gemms(shape, tp)
    weights = {n: torch.randn(k, m, device=dev, dtype=dtype) / k**0.5
               for n, (k, m) in gemms.items()}
    inputs = {n: torch.randn(tokens, k, device=dev, dtype=dtype) for n, (k, _) in gemms.items()}
    outs = {n: torch.empty(tokens, m, device=dev, dtype=dtype) for n, (_, m) in gemms.items()}
    cut = tokens // 2 // 16 * 16 if fp8_recipe != "none" else tokens // 2  # FP8: 16-row halves
    fp8 = contextlib.nullcontext()
    if fp8_recipe != "none":
        import transformer_engine.pytorch as te

        linears = {n: te.Linear(k, m, bias=False, params_dtype=dtype, device=dev)
                   for n, (k, m) in gemms.items()}
        with torch.no_grad():
            for n, lin in linears.items():
                lin.weight.copy_(weights[n].t())
                lin.is_first_microbatch = True  # Megatron's rule: quantized once, then cached
        fp8 = te.fp8_autocast(enabled=True, fp8_recipe=_te_recipe(fp8_recipe))

    def bf16(names, split: bool):
        for n in names:
            if split:
                torch.matmul(inputs[n][:cut], weights[n], out=outs[n][:cut])
                torch.matmul(inputs[n][cut:], weights[n], out=outs[n][cut:])
            else:
                torch.matmul(inputs[n], weights[n], out=outs[n])

    def woven_fp8(names, split: bool):
        from megatron_tokenweave import fp8_gemm

        for n in names:
            x, out = inputs[n], outs[n]
            with fp8_gemm.gemms(linears[n], x) as gemm:
                for rows in ((slice(0, cut), slice(cut, tokens)) if split else (slice(None),)):
                    gemm(x[rows], out[rows], None)

    groups = [*((g, (g,)) for g in gemms), ("layer", tuple(gemms))]
    with torch.no_grad(), fp8:
        plans = {(n, split, kind): capture_graph(lambda names=names, split=split, run=run:
                                                 run(names, split))
                 for n, names in groups for split in (False, True)
                 for kind, run in (("bf16", bf16), ("fp8", woven_fp8))
                 if kind == "bf16" or fp8_recipe != "none"}
        us = interleaved_medians({key: (lambda i, g=g: g.replay()) for key, g in plans.items()},
                                 iters=iters)
    kind = "bf16" if fp8_recipe == "none" else "fp8"
    rows = []
    for n in (*gemms, "layer"):
        whole, halves = us[(n, False, kind)], us[(n, True, kind)]
        row = dict(tokens=tokens, gemm=n, precision=bench_precision(fp8_recipe),
                   whole_us=round(whole, 2),
                   halves_us=round(halves, 2), whole_over_halves=round(whole / halves, 4))
        if kind == "fp8":
            row["bf16_whole_us"] = round(us[(n, False, "bf16")], 2)
        rows.append(row)
    return rows


def _plot(result: dict, path: str) -> None:
    """bf16 only: bars per GEMM and token count. With FP8 rows: the layer's whole / halves per
    precision, and how much faster the FP8 whole plan is than the bf16 one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    lengths = sorted({r["tokens"] for r in rows})
    title = f"{result['model']} GEMMs, TP={result['tp']} shard"
    fp8 = [r for r in rows if "bf16_whole_us" in r and r["gemm"] == "layer"]
    if not fp8:
        names = list(dict.fromkeys(r["gemm"] for r in rows))
        by = {(r["gemm"], r["tokens"]): r["whole_over_halves"] for r in rows}
        fig, ax = plt.subplots(figsize=(7, 4))
        grouped_bars(ax, lengths, {n: [by[(n, t)] for t in lengths] for n in names})
        ax.set_ylim(0.8, 1.05)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xlabel("tokens")
        ax.set_ylabel("time whole / time as two halves")
        ax.set_title(f"{title}: cost of the token split")
        ax.legend(loc="lower right", fontsize=8)
    else:
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
        for precision in dict.fromkeys(r["precision"] for r in fp8):
            mine = sorted((r for r in fp8 if r["precision"] == precision),
                          key=lambda r: r["tokens"])
            ts = [r["tokens"] for r in mine]
            left.plot(ts, [r["whole_over_halves"] for r in mine], "o-", label=precision)
            right.plot(ts, [r["bf16_whole_us"] / r["whole_us"] for r in mine], "o-",
                       label=precision)
        left.axhline(1.0, color="gray", lw=0.8)
        left.set_ylabel("layer GEMMs: time whole / time as two halves")
        left.set_title(f"{title}: cost of the token split")
        right.set_ylabel("layer GEMMs: bf16 whole time / FP8 whole time")
        right.set_title("FP8 against bf16 (whole plans)")
        for ax in (left, right):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("tokens")
            ax.legend(fontsize=8)
    fig.tight_layout()
    save_plot(fig, path, dpi=110)


def parser() -> argparse.ArgumentParser:
    parser = command_parser("split_cost", __doc__)
    add_model_argument(parser, "dense model shape")
    parser.add_argument("--tp", type=int, default=2,
                        help="tensor-parallel size whose per-rank GEMM shards are timed")
    parser.add_argument("--fp8-recipe", nargs="+", default=["none"],
                        choices=["none", "delayed", "tensorwise", "blockwise"],
                        help="none: bf16 GEMMs; else TE's FP8 GEMMs in each recipe (e4m3) as "
                             "the woven linears run them, beside the bf16 whole plan (TE "
                             "needed)")
    add_sweep_arguments(parser, tokens=[1024, 2048, 4096, 8192], iters=30, timed="GEMM plan",
                        out="docs/results/split_cost.json")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if any(r != "none" for r in args.fp8_recipe) and any(t % 32 for t in args.tokens):
        raise SystemExit("FP8 GEMMs take 16-row halves: --tokens must be multiples of 32")
    if not torch.cuda.is_available():
        raise SystemExit("the split-cost benchmark needs a GPU")
    shape = SHAPES[args.model]
    if shape.experts:
        raise SystemExit(f"{args.model} is a mixture of experts: dense shapes only")
    rows = []
    for recipe in args.fp8_recipe:
        for tokens in args.tokens:
            rows += measure(shape, args.tp, tokens, args.iters, recipe)
            layer = rows[-1]
            bf16 = f", bf16 whole {layer['bf16_whole_us']} us" if "bf16_whole_us" in layer else ""
            print(f"{tokens} tokens: layer GEMMs ({layer['precision']}) whole "
                  f"{layer['whole_us']} us, halves {layer['halves_us']} us "
                  f"({layer['whole_over_halves']:.3f}x){bf16}", flush=True)
    write_result("split_cost", argv, rows, args.out, _plot, model=args.model, tp=args.tp)


if __name__ == "__main__":
    main()
