"""The fitted kernel at forced token extents, in blocks and per tensor, each mode; cuBLAS's
block-scaled and per-tensor FP8 GEMMs beside; with --check each checked against cuBLAS first.

python docs/results/ab_blocks_scales/forced_extents.py --time --check --extents 104 208 \
    --tokens 4099 1000            (one process per build: PYTHONPATH=<the build's tree>)
--tokens-m E ...: in blocks also the tokens as the MMA's M at these weight extents
(ops/segments.FIT_TOKENS_M_EXTENTS), each mode (blkM<E>c / blkM<E>p).
--out PATH: the timed rows as JSON too.
Without --time each kernel runs once, eager (for `ncu -k regex:fit_gemm_kernel`)."""
import argparse
import datetime
import sys

import torch

from megatron_tokenweave.bench.gemm_fused import CALLS, _check, _fp8_inputs, _scaled_mm, cublas_rows
from megatron_tokenweave.bench.report import dump_result
from megatron_tokenweave.bench.split_cost import layer_gemms
from megatron_tokenweave.bench.timing import capture_graph, interleaved_medians
from megatron_tokenweave.kernels._ext import load_extension
from megatron_tokenweave.kernels.inbox import GemmInbox
from megatron_tokenweave.kernels.owner_gemm import owner_gemm
from megatron_tokenweave.models import SHAPES
from megatron_tokenweave.ops.gemm_rows import PaddedRows
from megatron_tokenweave.ops.segments import FP8_BLOCK_K, fit_tiles, segments
from megatron_tokenweave.ops.validate import Layout

ap = argparse.ArgumentParser()
ap.add_argument("--time", action="store_true")
ap.add_argument("--check", action="store_true")
ap.add_argument("--model", default="llama-3.3-70b")
ap.add_argument("--tp", type=int, default=2)
ap.add_argument("--tokens", type=int, nargs="+", default=[4099])
ap.add_argument("--gemm", default="proj")
ap.add_argument("--extents", type=int, nargs="+", default=[104])
ap.add_argument("--tokens-m", type=int, nargs="+", default=[], metavar="EXTENT")
ap.add_argument("--iters", type=int, default=20)
ap.add_argument("--out", help="with --time: also the rows as JSON (gemm_blocks_*_1gpu.json)")
a = ap.parse_args()
load_extension()
dev = torch.device("cuda")
sms = torch.cuda.get_device_properties(dev).multi_processor_count
shape = SHAPES[a.model]
k, n = layer_gemms(shape, a.tp)[a.gemm]
rows: list[dict] = []
for tokens in a.tokens:
    inbox = GemmInbox.loopback(a.tp, tokens, shape.hidden, torch.bfloat16, dev)
    alloc = max(cublas_rows(tokens), -(-tokens // 8) * 8 + 256)
    out = torch.empty(alloc, n, device=dev, dtype=torch.bfloat16)
    impls = {}
    singles = {}  # without --time: each kernel on one input, once
    for blocks in (True, False):
        xs, w, ops = _fp8_inputs(alloc, tokens, n, k, blocks, dev)
        tag = "blk" if blocks else "ten"
        impls[f"cublas_{tag}"] = (lambda f=_scaled_mm(w, ops, out, tokens), xs=xs:
                                  [f(x) for x in xs])
        w_in = PaddedRows()(w)
        forced = [(e, False) for e in a.extents] + [(e, True) for e in a.tokens_m if blocks]
        for e, tokens_m in forced:
            for coop in (True, False):
                if not blocks and e > 176:
                    continue
                tiles = fit_tiles(e, coop, FP8_BLOCK_K, blocks, tokens_m)
                s = segments(Layout.REPLICATED, a.tp, tokens, hidden=n, k=k, ctas=sms,
                             tiles=tiles)
                name = f"{tag}{'M' if tokens_m else ''}{e}{'c' if coop else 'p'}"
                def one(x, s=s, w=w_in, ops=ops, tokens=tokens, inbox=inbox):
                    return owner_gemm(x[:tokens], w, None, inbox, s, 0, sms, 1, fp8=ops)
                impls[name] = lambda one=one, xs=xs: [one(x) for x in xs]
                singles[name] = lambda one=one, x=xs[0]: one(x)
                if a.check:
                    try:
                        _check({"cublas": _scaled_mm(w, ops, out, tokens), name: one}, inbox,
                               {name: s}, xs[0], out[:tokens])
                        print("check ok", tokens, name, flush=True)
                    except AssertionError as err:
                        print("CHECK FAILED", tokens, name, str(err)[:300], flush=True)
    if not a.time:
        for name, fn in singles.items():
            print("launch", name, flush=True)
            fn()
        torch.cuda.synchronize()
        continue
    for fn in impls.values():
        fn()
    torch.cuda.synchronize()
    graphs = {i: capture_graph(fn) for i, fn in impls.items()}
    us = interleaved_medians({i: (lambda _, g=g: g.replay()) for i, g in graphs.items()},
                             iters=a.iters)
    cb, ct = us["cublas_blk"], us["cublas_ten"]
    for i, t in us.items():
        ref = cb if i.endswith("blk") or i.startswith("blk") else ct
        print(f"{a.model} {a.gemm} tp{a.tp} {tokens:6d} {i:12s} {t / CALLS:8.2f} us "
              f"x{ref / t:.3f} of cuBLAS", flush=True)
        rows.append(dict(model=a.model, gemm=a.gemm, tp=a.tp, tokens=tokens, impl=i,
                         us=round(t / CALLS, 2), x_cublas=round(ref / t, 3)))
    inbox.close()
if a.out and rows:
    with open(a.out, "w") as fh:
        dump_result({"gpu": torch.cuda.get_device_name(0),
                     "date": datetime.date.today().isoformat(),
                     "command": "python " + " ".join(sys.argv),
                     "shape": f"{a.model} {a.gemm} at TP {a.tp} (K {k}, N {n}), replicated; CUDA "
                              f"graphs of {CALLS} calls, interleaved medians of {a.iters} replays",
                     "rows": rows}, fh)
