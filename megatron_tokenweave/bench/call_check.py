"""What the call check costs the one-shot path: the fused op with the call tags checked (every
peer's tag vector compared before its rows are read) against the same kernel with the check off
(`KernelSettings(check_calls=False)`, a diagnostic), replicated layout, 8-256 tokens.

    python -m megatron_tokenweave.bench call_check --out docs/results/call_check_1gpu.json

One GPU, one process: the TP ranks are P communicators over P allocations of this GPU (each
rank's "peers" are the other allocations), and one timed unit is a CUDA graph in which every
rank's 10 calls run on a stream of its own, so the ranks' kernels run at the same time and
exchange through device memory, as over NVLink but without its latency: the kernels' own cost,
the check's included. Medians of interleaved replays (bench.timing). A point's cost is the
median over `--passes` passes, each with buffers and graphs of its own, captured in the other
order than the pass before: one pass's cost moved by up to 1.5 points from one process to the
next (one H100, 2026-12-08), as large as the 2 % goal it is read against.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from dataclasses import dataclass

import torch

from megatron_tokenweave.bench import command_parser
from megatron_tokenweave.bench.report import save_plot, write_result
from megatron_tokenweave.kernels.symmetric import ERROR_WORDS, PeerBuffer
from megatron_tokenweave.ops.validate import Layout

CALLS = 10  # calls per rank in one timed graph
EPS = 1e-5


@dataclass
class _Rank:
    """What KernelComm reads of a buffer, for rank `rank` of allocations that all live here."""

    bases: torch.Tensor
    rank: int
    world: int
    local_base: int
    nbytes: int
    device: torch.device
    timeout_s: float = 10.0
    multicast_base: int | None = None


class LoopbackRanks:
    """P allocations of [header | data] on one GPU, each a rank's buffer whose peers are the
    others (benchmarks only: nothing crosses a process or a link)."""

    def __init__(self, world: int, nbytes: int, device: torch.device) -> None:
        from megatron_tokenweave.kernels import load_extension

        load_extension()
        ops = torch.ops.tokenweave
        self.device, self.nbytes = device, nbytes
        header = int(ops.signal_pad_bytes())
        self.allocs = [int(ops.ipc_malloc(header + nbytes, device.index)) for _ in range(world)]
        for a in self.allocs:
            ops.init_header(a, device.index)
        data = [a + header for a in self.allocs]
        bases = torch.tensor(data + self.allocs, dtype=torch.int64, device=device)
        self.ranks = [_Rank(bases, r, world, data[r], nbytes, device) for r in range(world)]
        self.data = [ops.tensor_from_ptr(d, nbytes, device.index) for d in data]
        self.errors = [ops.tensor_from_ptr(a, 4 * ERROR_WORDS, device.index).view(torch.int32)
                       for a in self.allocs]

    def describe_errors(self) -> str:
        """What each rank's kernels recorded when they gave up (the signal pads' error words)."""
        torch.cuda.synchronize(self.device)
        said = [PeerBuffer.describe_error(rank, *(int(x) for x in words.tolist()))
                for rank, words in zip(self.ranks, self.errors, strict=True)]
        return "; ".join(s for s in said if s) or "no rank recorded an error"

    def close(self) -> None:
        for a in self.allocs:
            torch.ops.tokenweave.ipc_free(a, self.device.index)
        self.allocs = []


def _graph(comms, parts, residuals, weights, outs, normeds, streams) -> torch.cuda.CUDAGraph:
    """One replay: every rank's CALLS calls on its own stream, all forked from the capture stream
    before any joins it (a join between two forks would order a rank's calls after another's,
    which then waits for them until it times out)."""
    graph = torch.cuda.CUDAGraph()
    main = torch.cuda.Stream()
    with torch.cuda.graph(graph, stream=main):
        for stream in streams:  # every fork before any join: the ranks' calls run together
            stream.wait_stream(main)
        for r, comm in enumerate(comms):
            with torch.cuda.stream(streams[r]):
                for c in range(CALLS):
                    comm.run(parts[r], residuals[r], weights[r], EPS, outs[r], normeds[r],
                             Layout.REPLICATED, ctas=8, call=c, validate=False)
        for stream in streams:
            main.wait_stream(stream)
    return graph


def _measure(world: int, tokens: int, hidden: int, iters: int, on_first: bool = True) -> dict:
    from megatron_tokenweave.bench.timing import interleaved_medians
    from megatron_tokenweave.kernels import KernelComm, KernelSettings, oneshot_applies

    dev = torch.device("cuda", 0)
    dtype = torch.bfloat16
    if not oneshot_applies(Layout.REPLICATED, world, tokens, hidden, 2):
        raise ValueError(f"{tokens} tokens x {hidden} at TP {world} are past the one-shot path")
    ranks = LoopbackRanks(world, tokens * hidden * 2 + 4096, dev)
    parts = [d[:tokens * hidden * 2].view(dtype).view(1, tokens, hidden).normal_()
             for d in ranks.data]
    residual = torch.randn(tokens, hidden, device=dev, dtype=dtype)
    weight = torch.ones(hidden, device=dev, dtype=dtype)
    outs = [torch.empty(tokens, hidden, device=dev, dtype=dtype) for _ in range(world)]
    normeds = [torch.empty(1, tokens, hidden, device=dev, dtype=dtype) for _ in range(world)]
    streams = [torch.cuda.Stream() for _ in range(world)]
    graphs, comms = {}, []
    order = (("check_on", True), ("check_off", False))
    for name, check in order if on_first else order[::-1]:
        mine = [KernelComm(r, KernelSettings(check_calls=check)) for r in ranks.ranks]
        comms += mine
        graphs[name] = _graph(mine, parts, [residual] * world, [weight] * world, outs, normeds,
                              streams)
    torch.cuda.synchronize()
    want = sum(p[0].float() for p in parts) + residual.float()
    for out in outs:
        out.fill_(float("nan"))
    graphs["check_on"].replay()
    torch.cuda.synchronize()
    err = max((o.float() - want).abs().max().item() for o in outs)
    if not err < 0.5:  # bf16 rounding of sums of a few unit normals
        raise RuntimeError(f"TP {world} {tokens} x {hidden}: the ranks' outputs are off by {err} "
                           f"({ranks.describe_errors()})")
    medians = interleaved_medians({n: lambda _, g=g: g.replay() for n, g in graphs.items()},
                                  iters=iters)
    for comm in comms:
        comm.close()
    del graphs
    torch.cuda.synchronize()
    ranks.close()
    return dict(tp=world, tokens=tokens, hidden=hidden, max_err=err,
                check_on_us=medians["check_on"] / CALLS, check_off_us=medians["check_off"] / CALLS,
                cost=medians["check_on"] / medians["check_off"] - 1.0)


def _point(world: int, tokens: int, hidden: int, iters: int, passes: int) -> dict:
    """One point over `passes` passes: the median cost and times, every pass's cost beside."""
    runs = [_measure(world, tokens, hidden, iters, on_first=i % 2 == 0) for i in range(passes)]
    row = dict(tp=world, tokens=tokens, hidden=hidden,
               max_err=max(r["max_err"] for r in runs))
    for key in ("check_on_us", "check_off_us", "cost"):
        row[key] = statistics.median(r[key] for r in runs)
    row["costs"] = [r["cost"] for r in runs]
    return row


def _plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    keys = sorted({(r["tp"], r["hidden"]) for r in result["rows"]})
    for tp, hidden in keys:
        rows = sorted((r for r in result["rows"] if (r["tp"], r["hidden"]) == (tp, hidden)),
                      key=lambda r: r["tokens"])
        line, = ax.plot([r["tokens"] for r in rows], [100 * r["cost"] for r in rows],
                        marker="o", label=f"TP {tp}, hidden {hidden}")
        for r in rows:  # every pass's cost, where a point has several
            costs = r.get("costs", [])
            ax.scatter([r["tokens"]] * len(costs), [100 * c for c in costs], s=6,
                       color=line.get_color(), alpha=0.5)
    ax.axhline(2.0, color="grey", ls="--", lw=1, label="goal: 2 %")
    ax.axhline(0.0, color="black", lw=0.5)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens (one-shot path, replicated)")
    ax.set_ylabel("check on / check off - 1 (%), median of passes")
    ax.set_title(f"Call check cost, {result['gpu']} ({result['date']})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_plot(fig, path, dpi=120)


def parser() -> argparse.ArgumentParser:
    parser = command_parser("call_check", __doc__)
    parser.add_argument("--tp", nargs="+", type=int, default=[2, 4, 8],
                        help="TP sizes (ranks on this GPU)")
    parser.add_argument("--tokens", nargs="+", type=int, default=[8, 16, 32, 64, 128, 256],
                        help="tokens of a call (those the one-shot path takes)")
    parser.add_argument("--hidden", nargs="+", type=int, default=[4096, 8192],
                        help="hidden sizes")
    parser.add_argument("--iters", type=int, default=40, help="timed replays (interleaved)")
    parser.add_argument("--passes", type=int, default=3,
                        help="passes per point, each with its own buffers and graphs (median)")
    parser.add_argument("--out", default="docs/results/call_check_1gpu.json",
                        help="result JSON (plot beside it)")
    return parser


def main(argv: list[str] | None = None) -> None:
    cli = parser()
    args = cli.parse_args(argv)
    if args.passes < 1 or args.iters < 1:
        cli.error("--passes and --iters take at least 1")
    from megatron_tokenweave.kernels import oneshot_applies

    rows = []
    for world, hidden, tokens in itertools.product(args.tp, args.hidden, args.tokens):
        if not oneshot_applies(Layout.REPLICATED, world, tokens, hidden, 2):
            continue
        row = _point(world, tokens, hidden, args.iters, args.passes)
        each = " ".join(f"{100 * c:+.2f}" for c in row["costs"])
        print(f"TP {world} H {hidden} tokens {tokens}: on {row['check_on_us']:.2f} us, "
              f"off {row['check_off_us']:.2f} us, cost {100 * row['cost']:+.2f} % "
              f"(passes {each}), max err {row['max_err']:.3g}", flush=True)
        rows.append(row)
    write_result("call_check", argv, rows, args.out, _plot)


if __name__ == "__main__":
    main()
