"""A row-parallel GEMM and the all-reduce + residual + RMSNorm after it, per mechanism (2+ GPUs).

    python -m megatron_tokenweave.bench gemm_pair --out docs/results/gemm_pair_tp2.json

Per shape (one TP rank's shard of a model's o_proj or fc2), token count and layout, the same
work three ways: `cublas_nccl` (torch.matmul, then NCCL collectives in the model's dtype + add +
norm: the stock mechanism), `cublas_fused` (torch.matmul into the communicator's buffer, then
TokenWeave's fused op) and `gemm_fused` (the communicating GEMM, whose epilogue stores every tile
into its owner's inbox, then the owner's reduction: comm="gemm"). The last two also `_split`:
the tokens in two halves, half A's op on a side stream beside half B's GEMM, as the woven layer
runs them. `--tiles` adds `gemm_fused_<tiles>` (and its `_split`) with the GEMM's tiles forced
(ops/segments.TILES; `auto` is the policy's pick): over NVLink, a CTA's last tile's stores are
not overlapped by any compute of its own, so fewer, larger tiles per CTA leave more of the
reduce-scatter exposed at the GEMM's end (docs/kernel.md, "At 1K tokens"). `--release` adds
`gemm_fused_release_<who>` (with forced tiles, `gemm_fused_<tiles>_release_<who>`): who
publishes the tiles forced (ops/segments.RELEASES), the GEMM's CTAs after their last tile or the
consumer after the GEMM ends, which differ in when the peers' flags arrive. Each plan is one
CUDA graph; replays interleaved on every rank in the same order (bench/timing.py), bf16,
medians. Before timing, each plan's residual and normed outputs are checked against
cublas_nccl's. Rows: model, gemm, tp, tokens, layout, impl, us (rank 0's).
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron_tokenweave.bench import add_sweep_arguments, command_parser
from megatron_tokenweave.bench.split_cost import layer_gemms
from megatron_tokenweave.config import TokenWeaveConfig
from megatron_tokenweave.linears import gemm_into
from megatron_tokenweave.models import SHAPES
from megatron_tokenweave.ops.segments import RELEASES, TILES, GemmTiles, Segments, half_segments
from megatron_tokenweave.ops.validate import Layout
from megatron_tokenweave.schedule import Half, SideStream, plan_halves

GEMMS = {"o_proj": "proj", "fc2": "fc2"}
EPS = 1e-5
CTAS_ALONE, CTAS_BESIDE = 64, 16


class Pair:
    """One shape's inputs and outputs on this rank, and its plans (callables of no argument)."""

    def __init__(self, comm, layout: Layout, tokens: int, k: int, seed: int,
                 tiles: tuple[str, ...] = ("auto",), release: tuple[str, ...] = ("auto",)
                 ) -> None:
        world, rank = dist.get_world_size(comm.group), dist.get_rank(comm.group)
        hidden, dtype, dev = comm.hidden, comm.dtype, comm.device
        self.comm, self.layout = comm, layout
        self.tiles, self.release = tiles, release
        sp = layout is Layout.SEQUENCE_PARALLEL
        self.chunks = world if sp else 1
        self.n = tokens // world if sp else tokens
        rows = self.chunks * self.n
        gen = torch.Generator(device="cpu").manual_seed(seed + rank)  # this rank's shard
        self.x = torch.randn(rows, k, generator=gen).to(dev, dtype)
        self.w = (torch.randn(hidden, k, generator=gen) / k**0.5).to(dev, dtype)
        # The residual stream and the norm weight are the same on every rank (replicated: the
        # whole stream; sequence parallel: each rank's rows of one stream).
        shared = torch.Generator(device="cpu").manual_seed(seed)
        stream = torch.randn(self.chunks, self.n, hidden, generator=shared)
        self.residual = stream[rank if sp else 0].to(dev, dtype)
        self.norm = (1.0 + 0.1 * torch.randn(hidden, generator=shared)).to(dev, dtype)
        self.residual_out = torch.empty(self.n, hidden, device=dev, dtype=dtype)
        self.partial_out = torch.empty(rows, hidden, device=dev, dtype=dtype)  # cublas_nccl's
        self.side = SideStream(dev)

    def normed(self) -> torch.Tensor:
        return self.comm.normed[:self.chunks * self.n].view(self.chunks, self.n, -1)

    def plans(self) -> dict[str, Callable[[], None]]:
        plans = {
            "cublas_nccl": self._cublas_nccl,
            "cublas_fused": lambda: self._run(split=False, gemm=False),
            "cublas_fused_split": lambda: self._run(split=True, gemm=False),
        }
        for name, who in itertools.product(self.tiles, self.release):
            impl = "gemm_fused" + (f"_{name}" if name != "auto" else "") + (
                f"_release_{who}" if who != "auto" else "")
            forced = dict(tiles=TILES.get(name), release=None if who == "auto" else who)
            plans[impl] = lambda f=forced: self._run(split=False, gemm=True, **f)
            plans[f"{impl}_split"] = lambda f=forced: self._run(split=True, gemm=True, **f)
        return plans

    def _cublas_nccl(self) -> None:
        torch.matmul(self.x, self.w.t(), out=self.partial_out)
        part = self.partial_out.view(self.chunks, self.n, -1)
        self.comm.allreduce_rmsnorm(part, self.residual, self.norm, EPS, self.residual_out,
                                    self.normed(), self.layout, comm="collectives",
                                    validate=False)

    def _run(self, split: bool, gemm: bool, tiles: GemmTiles | None = None,
             release: str | None = None) -> None:
        woven_linear(self.comm, self.layout, self.x.view(self.chunks, self.n, -1), self.w, None,
                     even_halves(self.n, split), self.residual, self.norm, self.residual_out,
                     self.normed(), self.side, gemm=gemm, tiles=tiles, release=release,
                     validate=False)

    def check(self) -> list[str]:
        """Run every plan once; the names of those whose outputs differ from cublas_nccl's."""
        plans = self.plans()
        plans["cublas_nccl"]()
        want = self.residual_out.float().clone(), self.normed().float().clone()
        bad = []
        for name, run in plans.items():
            self.residual_out.fill_(float("nan"))
            self.normed().fill_(float("nan"))
            run()
            got = self.residual_out.float(), self.normed().float()
            for g, w in zip(got, want, strict=True):
                if not torch.allclose(g, w, rtol=3e-2, atol=3e-2):
                    bad.append(name)
                    break
        return bad


_UNALIGNED = TokenWeaveConfig(split_align=1)  # halves of n // 2 and the rest


def even_halves(n: int, split: bool) -> tuple[Half, ...]:
    """n rows a chunk in two halves of n // 2 and the rest (split, n >= 2), else one: the
    layer's plan_halves without its wave alignment."""
    return plan_halves(n, _UNALIGNED, split)


def woven_linear(comm, layout: Layout, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None, halves: tuple[Half, ...], residual: torch.Tensor,
                 norm: torch.Tensor | None, residual_out: torch.Tensor,
                 normed: torch.Tensor | None, side: SideStream, *, gemm: bool,
                 ctas: int | None = None, tiles: GemmTiles | None = None,
                 release: str | None = None, call: int = 0,
                 validate: bool = True) -> list[Segments]:
    """One row-parallel linear and its fused op as the woven layer runs them, alone: per half
    its GEMM over rows `halves[i]` of every chunk of x [chunks, n, K] (gemm: the communicating
    GEMM on `ctas` CTAs, default the agreed SMs less CTAS_BESIDE when split, `tiles` and
    `release` forced, else the policy's; else torch.matmul into the communicator's buffer),
    then its op (on `side` when split, beside the next half's GEMM); residual, residual_out
    [n, H], normed [chunks, n, H] (None without a norm; unsplit and replicated, also FP8 rows:
    ops.fp8_rows.Fp8Rows, whose scales belong to one call); half i's GEMM and op are call
    `call` * 2 + i (as the layer numbers them). The segments each communicating GEMM took, in
    half order."""
    chunks, world = x.shape[0], dist.get_world_size(comm.group)
    split = len(halves) > 1
    if ctas is None:
        ctas = comm.agreement.sms - (CTAS_BESIDE if split else 0)
    taken, pending = [], []
    for i, h in enumerate(halves):
        part = comm.partial[chunks * h.offset:chunks * (h.offset + h.rows)]
        part = part.view(chunks, h.rows, -1)
        seg = None
        if gemm:
            seg = half_segments(layout, world, halves, i, hidden=weight.shape[0],
                                k=weight.shape[1], ctas=ctas, first=h.offset,
                                chunk_stride=x.shape[1], tiles=tiles, release=release,
                                fitted=comm.fitted_gemm, long_k=comm.fitted_long_k)
            comm.row_gemm(x.reshape(-1, x.shape[-1]), weight, bias, seg, i, validate=validate,
                          ctas=ctas, call=call * 2 + i)
            taken.append(seg)
        else:
            gemm_into(h.of(x), weight, part)
            if bias is not None:
                part.add_(bias)
        rows = slice(h.offset, h.offset + h.rows)
        args = (part, residual[rows], norm, EPS, residual_out[rows],
                h.of(normed) if split and normed is not None else normed, layout)
        op = dict(comm="gemm" if gemm else "fused", segments=seg, set_index=i,
                  call=call * 2 + i, validate=validate)
        if not split:
            comm.allreduce_rmsnorm(*args, ctas=CTAS_ALONE, **op)
            continue
        with side.run():
            comm.allreduce_rmsnorm(*args, ctas=CTAS_BESIDE, **op)
        pending.append(side.record())
    for event in pending:
        SideStream.wait(event)
    return taken


def _measure(rank: int, world: int, args: argparse.Namespace) -> list[dict]:
    from megatron_tokenweave.bench.timing import capture_graph, interleaved_medians
    from megatron_tokenweave.communicator import Communicator

    dev = torch.device("cuda", rank)
    rows = []
    for model in args.models:
        shape = SHAPES[model]
        comm = Communicator(dist.group.WORLD, max(args.tokens), shape.hidden, torch.bfloat16,
                            dev, "kernel")
        comm.prepare_gemm()
        for name, key in GEMMS.items():
            k, _ = layer_gemms(shape, world)[key]
            for layout in args.layouts:
                for tokens in args.tokens:
                    pair = Pair(comm, Layout(layout), tokens, k, seed=tokens,
                                tiles=tuple(args.tiles), release=tuple(args.release))
                    bad = pair.check()
                    if bad:
                        raise RuntimeError(f"{model} {name} {layout} {tokens}: {bad} differ "
                                           "from cublas_nccl")
                    graphs = {impl: capture_graph(run) for impl, run in pair.plans().items()}
                    us = interleaved_medians({i: (lambda _, g=g: g.replay())
                                              for i, g in graphs.items()}, iters=args.iters)
                    rows += [dict(model=model, gemm=name, tp=world, tokens=tokens,
                                  layout=layout, impl=impl, us=round(t, 2))
                             for impl, t in us.items()]
                    if rank == 0:
                        base = us["cublas_nccl"]
                        print(f"{model} {name} {layout} {tokens}: " + ", ".join(
                            f"{i} {base / t:.3f}x" for i, t in us.items()), flush=True)
                    del graphs
        comm.destroy()
    return rows


def _plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megatron_tokenweave.bench.report import save_plot

    rows = result["rows"]
    keys = list(dict.fromkeys((r["model"], r["gemm"], r["layout"]) for r in rows))
    fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 4), squeeze=False)
    for ax, (model, gemm, layout) in zip(axes[0], keys, strict=True):
        mine = [r for r in rows if (r["model"], r["gemm"], r["layout"]) == (model, gemm, layout)]
        lengths = sorted({r["tokens"] for r in mine})
        by = {(r["impl"], r["tokens"]): r["us"] for r in mine}
        for impl in dict.fromkeys(r["impl"] for r in mine):
            ax.plot(lengths, [by[("cublas_nccl", t)] / by[(impl, t)] for t in lengths],
                    marker="o", label=impl)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens")
        ax.set_ylabel("speed-up over cuBLAS + NCCL + norm")
        ax.set_title(f"{model} {gemm}, {layout}, TP={result['rows'][0]['tp']}", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_plot(fig, path, dpi=110)


def parser() -> argparse.ArgumentParser:
    parser = command_parser("gemm_pair", __doc__)
    parser.add_argument("--models", nargs="+", default=["llama-3.3-70b"], choices=sorted(SHAPES),
                        metavar="MODEL", help="dense model shapes")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (one GPU each)")
    parser.add_argument("--layouts", nargs="+", default=["replicated", "sequence_parallel"],
                        choices=[x.value for x in Layout], help="layouts of the op")
    parser.add_argument("--tiles", nargs="+", default=["auto"], choices=["auto", *TILES],
                        help="the communicating GEMM's tiles: the policy's pick (auto) and/or "
                             "forced tile shapes, each its own gemm_fused_<tiles> rows")
    parser.add_argument("--release", nargs="+", default=["auto"], choices=["auto", *RELEASES],
                        help="who publishes the GEMM's tiles: the policy's pick (auto) and/or "
                             "forced, each its own ..._release_<who> rows")
    add_sweep_arguments(parser, tokens=[512, 1024, 2048, 4096, 8192], iters=20, timed="plan",
                        out="docs/results/gemm_pair_tp2.json",
                        tokens_help="tokens of one forward (all ranks' shards together)")
    return parser


def main(argv: list[str] | None = None) -> None:
    from megatron_tokenweave.bench.report import write_result
    from megatron_tokenweave.launch import spawn

    args = parser().parse_args(argv)
    if torch.cuda.device_count() < args.tp:
        raise SystemExit(f"the pair benchmark needs {args.tp} GPUs (one per rank)")
    rows = spawn(_measure, args.tp, args, backend="nccl")[0]
    write_result("gemm_pair", argv, rows, args.out, _plot)


if __name__ == "__main__":
    main()
