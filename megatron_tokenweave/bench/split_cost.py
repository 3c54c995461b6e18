"""What splitting the tokens costs before any communication, on one GPU.

    python -m megatron_tokenweave.bench split_cost --out docs/results/split_cost.json

The woven layer runs each tensor-parallel GEMM of a layer (qkv, proj, fc1, fc2 of `--model` at
`--tp`: this rank's shard) on the two halves of the tokens instead of once on all of them
(attention stays whole). Even with every all-reduce hidden, a woven block can then be no faster
than the stock block without communication (`te_nocomm`) times (whole / halves) of these GEMMs;
this measures that factor: per token count T, the layer's four GEMMs on T rows vs on T/2 + T - T/2
rows, each plan one CUDA graph, replays interleaved (bench/timing.py), bf16, torch's cuBLAS.
"""

from __future__ import annotations

import argparse

import torch

from megatron_tokenweave.bench import add_model_argument, add_sweep_arguments, command_parser
from megatron_tokenweave.bench.report import grouped_bars, write_result
from megatron_tokenweave.bench.timing import capture_graph, interleaved_medians
from megatron_tokenweave.models import SHAPES, Shape


def layer_gemms(shape: Shape, tp: int) -> dict[str, tuple[int, int]]:
    """(in, out) features of one rank's shard of each GEMM of a dense layer."""
    head_dim = shape.hidden // shape.heads
    qkv = (shape.hidden + 2 * shape.kv_groups * head_dim) // tp
    return {"qkv": (shape.hidden, qkv), "proj": (shape.hidden // tp, shape.hidden),
            "fc1": (shape.hidden, 2 * shape.ffn // tp), "fc2": (shape.ffn // tp, shape.hidden)}


def measure(shape: Shape, tp: int, tokens: int, iters: int) -> list[dict]:
    """Rows of whole / halves microseconds, per GEMM and for the layer's four together."""
    dev, dtype = torch.device("cuda"), torch.bfloat16
    gemms = layer_gemms(shape, tp)
    weights = {n: torch.randn(k, m, device=dev, dtype=dtype) / k**0.5
               for n, (k, m) in gemms.items()}
    inputs = {n: torch.randn(tokens, k, device=dev, dtype=dtype) for n, (k, _) in gemms.items()}
    outs = {n: torch.empty(tokens, m, device=dev, dtype=dtype) for n, (_, m) in gemms.items()}
    cut = tokens // 2

    def run(names, split: bool):
        for n in names:
            if split:
                torch.matmul(inputs[n][:cut], weights[n], out=outs[n][:cut])
                torch.matmul(inputs[n][cut:], weights[n], out=outs[n][cut:])
            else:
                torch.matmul(inputs[n], weights[n], out=outs[n])

    plans = {(n, split): capture_graph(lambda names=names, split=split: run(names, split))
             for n, names in [*((g, (g,)) for g in gemms), ("layer", tuple(gemms))]
             for split in (False, True)}
    us = interleaved_medians({key: (lambda i, g=g: g.replay()) for key, g in plans.items()},
                             iters=iters)
    return [dict(tokens=tokens, gemm=n, whole_us=round(us[(n, False)], 2),
                 halves_us=round(us[(n, True)], 2),
                 whole_over_halves=round(us[(n, False)] / us[(n, True)], 4))
            for n in (*gemms, "layer")]


def _plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    names = list(dict.fromkeys(r["gemm"] for r in rows))
    lengths = sorted({r["tokens"] for r in rows})
    by = {(r["gemm"], r["tokens"]): r["whole_over_halves"] for r in rows}
    fig, ax = plt.subplots(figsize=(7, 4))
    grouped_bars(ax, lengths, {n: [by[(n, t)] for t in lengths] for n in names})
    ax.set_ylim(0.8, 1.05)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xlabel("tokens")
    ax.set_ylabel("time whole / time as two halves")
    ax.set_title(f"{result['model']} GEMMs, TP={result['tp']} shard: cost of the token split")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parser() -> argparse.ArgumentParser:
    parser = command_parser("split_cost", __doc__)
    add_model_argument(parser, "dense model shape")
    parser.add_argument("--tp", type=int, default=2,
                        help="tensor-parallel size whose per-rank GEMM shards are timed")
    add_sweep_arguments(parser, tokens=[1024, 2048, 4096, 8192], iters=30, timed="GEMM plan",
                        out="docs/results/split_cost.json")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the split-cost benchmark needs a GPU")
    shape = SHAPES[args.model]
    if shape.experts:
        raise SystemExit(f"{args.model} is a mixture of experts: dense shapes only")
    rows = []
    for tokens in args.tokens:
        rows += measure(shape, args.tp, tokens, args.iters)
        layer = rows[-1]
        print(f"{tokens} tokens: layer GEMMs whole {layer['whole_us']} us, halves "
              f"{layer['halves_us']} us ({layer['whole_over_halves']:.3f}x)", flush=True)
    write_result("split_cost", argv, rows, args.out, _plot, model=args.model, tp=args.tp)


if __name__ == "__main__":
    main()
