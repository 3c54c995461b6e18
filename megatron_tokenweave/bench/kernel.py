"""Kernel benchmark, TP=2: NCCL all-reduce + add + RMSNorm vs torch symmetric-memory two-shot +
norm vs FlashInfer's TRT-LLM all-reduce + residual + RMSNorm fusion (where it imports) vs the
tokenweave fused kernel at several CTA counts, plus overlap beside a GEMM per mechanism.

    python -m megatron_tokenweave.bench kernel --out docs/results/kernel_tp2.json

Rows: tokenweave (sequence-parallel layout, bulk-copy path where it applies),
tokenweave_copy_engine (the same layout on the copy-engine data path),
tokenweave_replicated (--replicated-ctas; the layout NCCL+norm and FlashInfer produce; the
one-shot path where it applies: kernels.oneshot_applies), and where it applies also
tokenweave_replicated_barrier (a communicator with the one-shot path off) and
*_graph rows (flashinfer_graph, tokenweave_replicated_graph,
tokenweave_replicated_barrier_graph): CUDA-graph replays of 10 calls / 10, device time without
host overhead,
tokenweave_regs (a communicator with the bulk pipeline off: the register path, at --regs-ctas),
tokenweave_graph (--graph-ctas, CUDA-graph replay of 10 calls / 10: device time without host
overhead), tokenweave_localstores (--graph-ctas, diagnostics only: a communicator that skips
the remote stores of normed rows), flashinfer.
Overlap rows: see MECHANISMS (also written to the JSON).
With `--fp8-recipe R` (TE needed) also the replicated layout's FP8 form for a next linear in TE's
recipe R (e4m3): nccl+norm+quantize (NCCL, norm, TE's quantizer) against
tokenweave_replicated_fp8 (the op writing the FP8 rows itself: delayed and blockwise, as the
woven layer does) or, for tensorwise (current scaling, which the op cannot write: the scale
needs the whole call's amax), tokenweave_replicated+quantize (the op, then TE's quantizer). Every
row says its `precision` ("bf16", or the recipe's, precision.bench_precision).
    (or python -m megatron_tokenweave.bench.kernel ...)

Spawns 2 processes (NCCL, one GPU each). CUDA events, median of >= 25 timings after a warm-up,
inputs rotated over > L2 bytes. Never uses NVLink multicast (the env kill-switches are set).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import os
import statistics
import sys
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from megatron_tokenweave.bench import command_parser
from megatron_tokenweave.bench.fp8_rows import RECIPE_SCALING, fp8_rows_for, te_quantizer
from megatron_tokenweave.bench.report import dump_result
from megatron_tokenweave.bench.timing import capture_graph
from megatron_tokenweave.launch import NO_MULTICAST_ENV, free_port
from megatron_tokenweave.precision import WOVEN_FP8_RECIPES, bench_precision

NVLINK_BOUND_GBPS = 381.0
EPS = 1e-5
L2_BYTES = 60 << 20
GRAPH_CALLS = 10
CE_MECHANISM = "copy_engine_probe"


@contextlib.contextmanager
def gemm_sm_carveout(sms: int) -> Iterator[None]:
    """Inside the scope, cuBLASLt GEMMs target all but `sms` SMs (torch's experimental carve-out;
    read when a GEMM is issued): the `tokenweave_p2p_gemm_carveout` mechanism; the layers never
    do this (it slowed the GEMM more than it helped the kernel, docs/kernel.md)."""
    if sms <= 0 or not hasattr(torch._C, "_set_sm_carveout_experimental"):
        yield
        return
    previous_library = torch.backends.cuda.preferred_blas_library()
    previous = torch._C._get_sm_carveout_experimental()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    torch._C._set_sm_carveout_experimental(sms)
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(previous)
        torch.backends.cuda.preferred_blas_library(previous_library)


MECHANISMS = {
    "tokenweave_p2p_side_stream": "the fused op (SM-driven peer loads/stores, bulk copies) on a "
    "high-priority side stream, launched before the GEMM",
    "tokenweave_p2p_gemm_carveout": "the same, with the GEMM told to leave `ctas` SMs free "
    "(cuBLASLt SM-count target); gemm_carveout_us = that GEMM alone",
    "tokenweave_copy_engine_side_stream": "the fused op's copy-engine data path (peers' partial "
    "rows, then their normed rows, pulled by cudaMemcpyAsync; one-CTA barrier kernels; `ctas` "
    "CTAs reduce and normalize local rows) on the side stream",
    CE_MECHANISM: "probe, data movement only: the bytes the op moves per rank (my rows of the "
    "peer's partial in, my normed rows out) as two cudaMemcpyAsync copies on the side stream; "
    "no reduction, no inter-rank ordering",
}


def _time(fn, iters: int, warmup: int = 5, stream=None) -> float:
    """Median microseconds of `iters` back-to-back calls, one event pair each."""
    for _ in range(warmup):
        fn(0)
    torch.cuda.synchronize()
    s = stream or torch.cuda.current_stream()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(iters)]
    for i, (a, b) in enumerate(ev):
        a.record(s)
        fn(i + 1)
        b.record(s)
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ev) * 1e3


def _time_graph(fn, iters: int) -> float:
    """Median microseconds per call of fn(0..GRAPH_CALLS-1) captured in one CUDA graph: device
    time without the host's per-call overhead."""
    def calls() -> None:
        for j in range(GRAPH_CALLS):
            fn(j)

    g = capture_graph(calls)
    return _time(lambda i: g.replay(), iters) / GRAPH_CALLS


def _rot(nbytes: int, cap: int = 8) -> int:
    return max(2, min(cap, -(-2 * L2_BYTES // max(nbytes, 1))))


def _worker(rank: int, world: int, port: int, args, queue) -> None:
    os.environ.update(NO_MULTICAST_ENV)
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=dev)
    group = dist.group.WORLD
    from megatron_tokenweave import kernels
    from megatron_tokenweave.ops.validate import Layout

    H, dtype = args.hidden, torch.bfloat16
    es = 2
    w = torch.ones(H, dtype=dtype, device=dev) + 0.01 * torch.randn(H, device=dev).to(dtype)
    buf = kernels.SymmetricBuffer(group, args.buffer_mb << 20, dev)
    mirror = kernels.CopyEngineMirror(buf, buf.nbytes)
    # One communicator per protocol setting compared (every rank creates the same ones).
    variants = {"default": kernels.KernelSettings(),
                "barrier": kernels.KernelSettings(oneshot=False),
                "regs": kernels.KernelSettings(bulk=False),
                "localstores": kernels.KernelSettings(local_stores_only=True)}
    comms = {name: kernels.KernelComm(buf, settings) for name, settings in variants.items()}
    comms["default"].attach_mirror(mirror)
    rows, overlap = [], []
    symm_reason = None
    symm = None
    try:
        import torch.distributed._symmetric_memory as symm_mem

        symm = symm_mem
        symm_mem.enable_symm_mem_for_group(group.group_name)
    except Exception as exc:  # pragma: no cover - depends on the torch build
        symm_reason = f"torch symmetric memory unavailable: {exc!r}"

    flashinfer, flashinfer_note = None, "not requested (--flashinfer)"
    if args.flashinfer:
        from megatron_tokenweave.bench.flashinfer_ar import flashinfer_fused

        flashinfer, flashinfer_note = flashinfer_fused(group, max(args.tokens), H, dtype, dev)
        print(f"rank {rank}: flashinfer: {flashinfer_note}", flush=True)
        everywhere = torch.tensor([flashinfer is not None], dtype=torch.int32, device=dev)
        dist.all_reduce(everywhere, op=dist.ReduceOp.MIN, group=group)
        if flashinfer is not None and not everywhere.item():
            # Set up here only; its close() is collective, so it is dropped unclosed.
            flashinfer, flashinfer_note = None, "set up on this rank only (another failed)"

    def add_row(impl, T, ctas, us, precision="bf16"):
        rows.append(dict(impl=impl, tokens=T, hidden=H, dtype="bf16", tp=world, ctas=ctas,
                         us=round(us, 2), precision=precision))

    def fp8_rows(T, xs, k, r, rparts, kr, outs):
        """The replicated layout's FP8 form for the next linear in the recipe (module doc)."""
        precision = bench_precision(args.fp8_recipe)
        scaling = RECIPE_SCALING.get(args.fp8_recipe)
        quantizer = te_quantizer(scaling or "current", dev)

        def nccl_norm_quantize(i):
            x = xs[i % k]
            dist.all_reduce(x, group=group)
            quantizer(F.rms_norm(x + r, (H,), w, EPS))

        add_row("nccl+norm+quantize", T, 0, _time(nccl_norm_quantize, args.iters), precision)
        written = fp8_rows_for(scaling, T, H, dev) if scaling else None
        for ctas in args.replicated_ctas:
            def rep(i, ctas=ctas):
                normed = written if written is not None else outs[1].view(1, T, H)
                comms["default"].run(rparts[i % kr], r, w, EPS, outs[0], normed,
                                     Layout.REPLICATED, ctas=ctas, validate=False)
                if written is None:
                    quantizer(outs[1])

            impl = "tokenweave_replicated_fp8" if scaling else "tokenweave_replicated+quantize"
            add_row(impl, T, ctas, _time(rep, args.iters), precision)

    def one_tokens(T):
        nonlocal symm_reason
        nbytes = T * H * es
        k = _rot(nbytes)
        xs = [torch.randn(T, H, device=dev).to(dtype) for _ in range(k)]
        r = torch.randn(T, H, device=dev).to(dtype)

        def nccl_norm(i):
            x = xs[i % k]
            dist.all_reduce(x, group=group)
            F.rms_norm(x + r, (H,), w, EPS)

        add_row("nccl+norm", T, 0, _time(nccl_norm, args.iters))
        if symm is not None:
            try:
                sx = symm.empty(T, H, dtype=dtype, device=dev)
                symm.rendezvous(sx, group.group_name)

                def symm_norm(i):
                    sx.copy_(xs[i % k])
                    torch.ops.symm_mem.two_shot_all_reduce_(sx, "sum", group.group_name)
                    F.rms_norm(sx + r, (H,), w, EPS)

                add_row("symm_two_shot+norm", T, 0, _time(symm_norm, args.iters))
            except Exception as exc:
                symm_reason = f"symm_mem two_shot_all_reduce_ failed: {exc!r}"[:300]

        outs = (torch.empty_like(r), torch.empty_like(r))
        # Where the one-shot path applies: also device time (graph replays) and the barrier path.
        graphed = kernels.oneshot_applies(Layout.REPLICATED, world, T, H, es)
        if flashinfer is not None:  # replicated layout: every rank gets all T rows
            for impl, oneshot in (("flashinfer", None), ("flashinfer_twoshot", False)):
                def fi(i, o=oneshot):
                    flashinfer(xs[i % k], r, w, EPS, *outs, oneshot=o)

                add_row(impl, T, 0, _time(fi, args.iters))
                if graphed and oneshot is None:
                    add_row("flashinfer_graph", T, 0, _time_graph(fi, args.iters))

        # tokenweave, replicated layout: partial [1, T, H] (in the buffer), normed [1, T, H]
        kr = max(1, min(k, buf.nbytes // nbytes))
        rparts = [buf.view(dtype, (1, T, H), j * nbytes) for j in range(kr)]
        for p in rparts:
            p.normal_()
        for ctas in args.replicated_ctas:
            def rep(i, ctas=ctas, comm=comms["default"]):
                comm.run(rparts[i % kr], r, w, EPS, outs[0], outs[1].view(1, T, H),
                         Layout.REPLICATED, ctas=ctas, validate=False)

            add_row("tokenweave_replicated", T, ctas, _time(rep, args.iters))
            if graphed:
                add_row("tokenweave_replicated_graph", T, ctas, _time_graph(rep, args.iters))
                barrier = functools.partial(rep, ctas=ctas, comm=comms["barrier"])
                add_row("tokenweave_replicated_barrier", T, ctas, _time(barrier, args.iters))
                add_row("tokenweave_replicated_barrier_graph", T, ctas,
                        _time_graph(barrier, args.iters))

        if args.fp8_recipe != "none":
            fp8_rows(T, xs, k, r, rparts, kr, outs)

        # tokenweave, sequence-parallel layout: partial [2, T/2, H] and normed [2, T/2, H]
        n = T // world
        slot = world * n * H * es
        k = max(1, min(_rot(slot), (buf.nbytes // slot) - 1))
        parts = [buf.view(dtype, (world, n, H), j * slot) for j in range(k)]
        for p in parts:
            p.normal_()
        normed = buf.view(dtype, (world, n, H), k * slot)
        res = torch.randn(n, H, device=dev).to(dtype)
        res_out = torch.empty_like(res)
        for ctas in args.ctas:
            def tw(i, ctas=ctas, comm=comms["default"], path="sm"):
                comm.run(parts[i % k], res, w, EPS, res_out, normed, Layout.SEQUENCE_PARALLEL,
                         ctas=ctas, path=path, validate=False)

            add_row("tokenweave", T, ctas, _time(tw, args.iters))
            tw_ce = functools.partial(tw, ctas=ctas, path="copy_engine")
            add_row("tokenweave_copy_engine", T, ctas, _time(tw_ce, args.iters))
            if ctas in args.regs_ctas:  # the register path (no bulk copies), for comparison
                regs = functools.partial(tw, ctas=ctas, comm=comms["regs"])
                add_row("tokenweave_regs", T, ctas, _time(regs, args.iters))
            if ctas == args.graph_ctas:  # diagnostics: normed rows not stored to the peer
                local = functools.partial(tw, ctas=ctas, comm=comms["localstores"])
                add_row("tokenweave_localstores", T, ctas, _time(local, args.iters))
            if ctas == args.graph_ctas:  # device time without the host's per-call overhead
                add_row("tokenweave_graph", T, ctas, _time_graph(tw, args.iters))

        # Overlap: the op on T/2 tokens on a high-priority side stream beside the GEMM
        # [T/2, H] x [H, gemm_n] (the other half's gate_up) on the main stream, per mechanism.
        half = T // 2
        nh = max(1, half // world)
        a = torch.randn(half, H, device=dev).to(dtype)
        bmat = torch.randn(H, args.gemm_n, device=dev).to(dtype)
        part_o = buf.view(dtype, (world, nh, H), 0)
        normed_off = ((world * nh * H * es + 255) // 256) * 256
        normed_o = buf.view(dtype, (world, nh, H), normed_off)
        res_o = torch.randn(nh, H, device=dev).to(dtype)
        res_oo = torch.empty_like(res_o)
        side = torch.cuda.Stream(priority=-5)
        main = torch.cuda.current_stream()

        def gemm(i):
            a @ bmat

        gemm_us = _time(gemm, args.iters)

        def kernel_at(ctas, path="sm"):
            def kern(i):
                comms["default"].run(part_o, res_o, w, EPS, res_oo, normed_o,
                                     Layout.SEQUENCE_PARALLEL, ctas=ctas, path=path,
                                     validate=False)
            return kern

        # Copy engines (probe, data movement only): the bytes the op moves per rank, my rows of
        # the peer's partial in and my normed rows out, as two cudaMemcpyAsync copies; no
        # reduction, no inter-rank ordering.
        peer = (rank + 1) % world
        row_bytes = nh * H * es
        peer_data = buf.peer_data[peer]
        pull_src = torch.ops.tokenweave.tensor_from_ptr(
            peer_data + rank * row_bytes, row_bytes, dev.index)
        push_dst = torch.ops.tokenweave.tensor_from_ptr(
            peer_data + normed_off + rank * row_bytes, row_bytes, dev.index)
        pull_dst = torch.empty(row_bytes, dtype=torch.uint8, device=dev)
        push_src = normed_o[rank].view(-1).view(torch.uint8)

        def copies(i):
            pull_dst.copy_(pull_src)
            push_dst.copy_(push_src)

        mechanisms = [(CE_MECHANISM, 0, copies, 0)]
        for ctas in args.ctas:
            mechanisms.append(("tokenweave_p2p_side_stream", ctas, kernel_at(ctas), 0))
            mechanisms.append(("tokenweave_copy_engine_side_stream", ctas,
                               kernel_at(ctas, "copy_engine"), 0))
            if ctas in args.carveout_ctas:
                mechanisms.append(("tokenweave_p2p_gemm_carveout", ctas, kernel_at(ctas), ctas))
        for mechanism, ctas, op, carveout in mechanisms:
            def both(i, op=op):
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    op(i)
                a @ bmat
                main.wait_stream(side)

            op_us = _time(op, args.iters)
            with gemm_sm_carveout(carveout):
                gemm_alone_us = _time(gemm, args.iters) if carveout else gemm_us
                both_us = _time(both, args.iters)
            overlap.append(dict(tokens=T, mechanism=mechanism, ctas=ctas,
                                gemm_us=round(gemm_us, 2), kernel_us=round(op_us, 2),
                                both_us=round(both_us, 2),
                                gemm_carveout_us=round(gemm_alone_us, 2)))
        dist.barrier(group=group)  # the peers' copies into my buffer are done
    for T in args.tokens:
        one_tokens(T)
        torch.cuda.empty_cache()
    buf.check_error()
    for comm in comms.values():
        comm.close()
    buf.close()
    if flashinfer is not None:
        flashinfer.close()
    if rank == 0:
        queue.put(dict(rows=rows, overlap=overlap, symm_reason=symm_reason,
                       flashinfer_note=flashinfer_note,
                       gpu=torch.cuda.get_device_name(dev)))
    dist.barrier()
    dist.destroy_process_group()


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megatron_tokenweave.bench.report import save_plot

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    impls = {}
    for r in result["rows"]:
        key = r["impl"] if not r["ctas"] else f"{r['impl']} {r['ctas']} CTAs"
        impls.setdefault(key, []).append((r["tokens"], r["us"]))
    for key, pts in impls.items():
        pts.sort()
        ax1.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=key)
    toks = sorted({r["tokens"] for r in result["rows"]})
    H = result["rows"][0]["hidden"]
    ax1.plot(toks, [t * H * 2 / (NVLINK_BOUND_GBPS * 1e3) for t in toks], "k--",
             label="NVLink bound (T*H*2B / 381 GB/s)")
    ax1.set(xscale="log", yscale="log", xlabel="tokens", ylabel="us",
            title=f"all-reduce + residual + RMSNorm, TP=2, H={H}, bf16")
    ax1.legend(fontsize=7)
    series: dict[tuple[str, int], list[dict]] = {}
    for o in result["overlap"]:
        series.setdefault((o["mechanism"], o["ctas"]), []).append(o)
    for (mechanism, ctas), os_ in sorted(series.items()):
        os_.sort(key=lambda o: o["tokens"])
        ax2.plot([o["tokens"] for o in os_],
                 [(o["gemm_us"] + o["kernel_us"]) / o["both_us"] for o in os_], marker="o",
                 label=f"{mechanism} {ctas} CTAs" if ctas else mechanism)
    ax2.axhline(1.0, color="k", lw=0.5)
    ax2.set(xscale="log", xlabel="tokens", ylabel="(gemm + kernel) / both",
            title="overlap beside GEMM [T/2, H] x [H, 28672] (>1: overlap helps)")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    save_plot(fig, path, dpi=110)


def parser() -> argparse.ArgumentParser:
    ap = command_parser("kernel", __doc__)
    ap.add_argument("--out", default="docs/results/kernel_tp2.json", help="result JSON")
    ap.add_argument("--plot", default=None, help="PNG path (default: --out with .png)")
    ap.add_argument("--tokens", type=int, nargs="+",
                    default=[128, 256, 512, 1024, 2048, 4096, 8192],
                    help="token counts of one op (all ranks' rows together)")
    ap.add_argument("--ctas", type=int, nargs="+", default=[4, 8, 16, 32, 64],
                    help="CTA counts of the fused kernel")
    ap.add_argument("--hidden", type=int, default=8192, help="hidden size")
    ap.add_argument("--gemm-n", type=int, default=28672,
                    help="overlap: N of the GEMM [T/2, H] x [H, N] beside the op")
    ap.add_argument("--iters", type=int, default=25, help="timed calls per case")
    ap.add_argument("--regs-ctas", type=int, nargs="*", default=[16, 64],
                    help="CTA counts also timed on the register path (TOKENWEAVE_NO_BULK=1)")
    ap.add_argument("--graph-ctas", type=int, default=16,
                    help="CTA count also timed as CUDA-graph replays of 10 calls")
    ap.add_argument("--carveout-ctas", type=int, nargs="*", default=[16, 32],
                    help="CTA counts also overlapped with the GEMM leaving that many SMs free "
                         "(cuBLASLt SM-count target)")
    ap.add_argument("--replicated-ctas", type=int, nargs="*", default=[16, 64],
                    help="CTA counts also timed in the replicated layout (what FlashInfer's "
                         "fusion and NCCL+norm produce)")
    ap.add_argument("--flashinfer", action=argparse.BooleanOptionalAction, default=True,
                    help="time FlashInfer's TRT-LLM all-reduce + residual + RMSNorm fusion "
                         "where it imports (multicast-free IPC workspace only)")
    ap.add_argument("--record-out", default=None,
                    help="--out value to record in the JSON's command (default: --out)")
    ap.add_argument("--buffer-mb", type=int, default=768,
                    help="symmetric (peer-mapped) buffer per rank, MiB")
    ap.add_argument("--fp8-recipe", default="none", choices=["none", *WOVEN_FP8_RECIPES],
                    help="also time the replicated layout's FP8 form for a next linear in this TE "
                         "recipe (e4m3; needs TransformerEngine): rows with its precision")
    return ap


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    os.environ.update(NO_MULTICAST_ENV)
    if args.fp8_recipe != "none" and te_quantizer("blocks", torch.device("cpu")) is None:
        sys.exit("--fp8-recipe needs TransformerEngine (its quantizers)")
    if torch.cuda.device_count() < 2:
        sys.exit("the kernel benchmark needs 2 GPUs")
    from megatron_tokenweave import kernels

    kernels.load_extension()  # build once before spawning
    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.spawn(_worker, args=(2, port, args, queue), nprocs=2, join=True)
    got = queue.get()
    result = dict(gpu=got["gpu"], date=datetime.date.today().isoformat(),
                  command=_command(argv if argv is not None else sys.argv[1:], args),
                  nvlink_bound_GBps=NVLINK_BOUND_GBPS, rows=got["rows"], overlap=got["overlap"])
    result["flashinfer_note"] = got["flashinfer_note"]
    result["mechanisms"] = MECHANISMS
    if got["symm_reason"]:
        result["symm_two_shot_note"] = got["symm_reason"]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        dump_result(result, f)
    plot(result, args.plot or os.path.splitext(args.out)[0] + ".png")
    _print_table(result)
    return result


def _col(r: dict) -> str:
    short = {"tokenweave": "tw", "tokenweave_copy_engine": "ce", "tokenweave_regs": "regs",
             "tokenweave_graph": "graph",
             "tokenweave_localstores": "lst", "tokenweave_replicated": "rep",
             "tokenweave_replicated_barrier": "repb", "tokenweave_replicated_graph": "repG",
             "tokenweave_replicated_barrier_graph": "repbG"}
    return f"{short[r['impl']]}{r['ctas']}" if r["impl"] in short else r["impl"]


def _command(argv: list[str], args) -> str:
    """The command line to record: --out replaced by --record-out, --record-out dropped."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--record-out", "--out"):
            skip = True
            continue
        if a.startswith(("--record-out=", "--out=")):
            continue
        out.append(a)
    out += ["--out", args.record_out or args.out]
    return "python -m megatron_tokenweave.bench kernel " + " ".join(out)


def _print_table(result: dict) -> None:
    H = result["rows"][0]["hidden"]
    toks = sorted({r["tokens"] for r in result["rows"]})
    cols = []
    for r in result["rows"]:
        c = _col(r)
        if c not in cols:
            cols.append(c)
    table = {(r["tokens"], _col(r)): r["us"] for r in result["rows"]}
    print("tokens  bound " + " ".join(f"{c:>12}" for c in cols))
    for t in toks:
        bound = t * H * 2 / (NVLINK_BOUND_GBPS * 1e3)
        print(f"{t:6d} {bound:6.1f} " + " ".join(f"{table.get((t, c), float('nan')):12.1f}"
                                                  for c in cols))
    print("overlap: tokens mechanism ctas gemm_us op_us both_us hidden")
    for o in result["overlap"]:
        hidden = (o["gemm_us"] + o["kernel_us"] - o["both_us"]) / o["kernel_us"]
        print(f"  {o['tokens']:6d} {o['mechanism']:30s} {o['ctas']:3d} {o['gemm_us']:9.1f} "
              f"{o['kernel_us']:9.1f} {o['both_us']:9.1f} {hidden:6.0%}")


if __name__ == "__main__":
    main()
