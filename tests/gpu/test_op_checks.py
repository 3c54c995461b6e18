"""The extension's own argument checks (csrc/include/tokenweave/check.h) raise RuntimeError with
their message, numbers in it included, when an op is called directly with bad arguments (the
layer, the communicator and the launchers check in Python first, so only a direct call reaches
them). Each case runs in a process of its own: on the GPU image of 2026-12-04 a TORCH_CHECK
message that streamed an integer ended the process with a segmentation fault instead of
raising, which would take the test process down with it. Skips cleanly without a GPU."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from _kernels import kernels_or_skip  # tests/ is on sys.path (conftest.py)

_PRELUDE = """
import torch
from megatron_tokenweave.kernels import load_extension
load_extension()
dev = torch.device("cuda", 0)
bf16 = torch.bfloat16
inbox = torch.empty(1 << 22, dtype=bf16, device=dev)
regions = [inbox.data_ptr(), inbox.data_ptr()]
geometry = [0, 0, 512, 0, 0, 0, 1, 256, 128, 64, 0, 0, 0, 0, 0]
x = torch.randn(256, 4096, device=dev, dtype=bf16)
w = torch.randn(1024, 4096, device=dev, dtype=bf16)
"""

# (case, the call, a part of the message it must raise)
CASES = [
    ("ipc_malloc of 0 bytes", "torch.ops.tokenweave.ipc_malloc(0, 0)",
     "ipc_malloc needs nbytes > 0, got 0"),
    ("fit_gemm in-features 100",
     "k = torch.randn(256, 100, device=dev, dtype=bf16)\n"
     "torch.ops.tokenweave.fit_gemm(k, torch.randn(1024, 100, device=dev, dtype=bf16), None, "
     "regions, geometry, 8, [], None, [])",
     "in-features must be a positive multiple of 8 and out-features of 8 (16-byte rows), "
     "got 100 and 1024"),
    ("fit_gemm block rows 180",
     "geometry[9] = 180\n"
     "torch.ops.tokenweave.fit_gemm(x, w, None, regions, geometry, 8, [], None, [])",
     "in 16..176, got 180"),
    ("fit_gemm 14 geometry entries",
     "torch.ops.tokenweave.fit_gemm(x, w, None, regions, geometry[:14], 8, [], None, [])",
     "got 14 entries"),
    ("fit_gemm split K in the ping-pong mode",
     "geometry[13:15] = [4, 8]\n"
     "torch.ops.tokenweave.fit_gemm(x, w, None, regions, geometry, 8, [], None, [])",
     "split K takes the cooperative mode outside pairs, 16-bit or per-tensor e4m3 operands"),
    ("fit_gemm split K past the call's tiles",
     "geometry[10], geometry[13:15] = 1, [17, 1]\n"
     "torch.ops.tokenweave.fit_gemm(x, w, None, regions, geometry, 8, [], None, [])",
     "split K takes 0..16 split tiles and 1..split tiles x 64 K steps a CTA, got 17 tiles, 1 "
     "steps"),
    ("fit_gemm split K, no steps a CTA",
     "geometry[10], geometry[13:15] = 1, [4, 0]\n"
     "torch.ops.tokenweave.fit_gemm(x, w, None, regions, geometry, 8, [], None, [])",
     "got 4 tiles, 0 steps"),
    ("fit_gemm split K on more CTAs than given",
     "geometry[10], geometry[13:15] = 1, [16, 1]\n"
     "torch.ops.tokenweave.fit_gemm(x, w, None, regions, geometry, 8, [], None, [])",
     "16 split tiles at 1 K steps a CTA take 1024 CTAs, more than the 8 given"),
    ("fit_gemm split K without its flags and sums",
     "geometry[10], geometry[13:15] = 1, [16, 128]\n"
     "torch.ops.tokenweave.fit_gemm(x, w, None, regions, geometry, 8, [], None, [])",
     "split K takes [flags, sums]: contiguous int32 of at least 8 and float32 of at least "
     "131072 elements on x's device"),
    ("fit_gemm rows past the segments",
     "geometry[7] = 300\n"
     "torch.ops.tokenweave.fit_gemm(x, w, None, regions, geometry, 8, [], None, [])",
     "300 rows do not split into 2 segments of 128"),
    ("fit_gemm x rows 8 bytes past 16",
     "xp = torch.randn(256, 4100, device=dev, dtype=bf16)[:, :4096]\n"
     "torch.ops.tokenweave.fit_gemm(xp, w, None, regions, geometry, 8, [], None, [])",
     "x's rows must be contiguous, at least K apart and a multiple of 16 bytes apart; got "
     "strides (4100, 1)"),
    ("fit_gemm float32",
     "torch.ops.tokenweave.fit_gemm(x.float(), w.float(), None, regions, geometry, 8, [], None, "
     "[])",
     "must both be bf16, both fp16 or both e4m3"),
    ("fit_gemm e4m3 without scales",
     "e4 = torch.float8_e4m3fn\n"
     "torch.ops.tokenweave.fit_gemm(x.to(e4), w.to(e4), None, regions, geometry, 8, [], bf16, [])",
     "e4m3 operands take [x scale_inv, weight scale_inv], 16-bit ones none; got 0"),
    ("fit_gemm e4m3 into float32 rows",
     "e4, one = torch.float8_e4m3fn, torch.ones(1, device=dev)\n"
     "torch.ops.tokenweave.fit_gemm(x.to(e4), w.to(e4), None, regions, geometry, 8, [one, one], "
     "torch.float32, [])",
     "rows of bf16 or fp16"),
    ("fit_gemm block scales of the wrong shape",
     "e4 = torch.float8_e4m3fn\n"
     "xs, ws = torch.ones(32, 255, device=dev), torch.ones(8, 32, device=dev)\n"
     "torch.ops.tokenweave.fit_gemm(x.to(e4), w.to(e4), None, regions, geometry, 8, [xs, ws], "
     "bf16, [])",
     "block scales must be x's [32, a multiple of 4 >= 256] and the weight's [8, >= 32], got "
     "[32, 255] and [8, 32]"),
    ("fit_gemm block scales, the weight's not 2-D",
     "e4 = torch.float8_e4m3fn\n"
     "xs, ws = torch.ones(32, 256, device=dev), torch.ones((), device=dev)\n"
     "torch.ops.tokenweave.fit_gemm(x.to(e4), w.to(e4), None, regions, geometry, 8, [xs, ws], "
     "bf16, [])",
     "block scales are 2-D, x's has 2 dims and the weight's 0"),
    ("fit_gemm block scales, x's 4 bytes off 16",
     "e4 = torch.float8_e4m3fn\n"
     "xs = torch.ones(32 * 256 + 4, device=dev)[1:1 + 32 * 256].view(32, 256)\n"
     "ws = torch.ones(8, 32, device=dev)\n"
     "torch.ops.tokenweave.fit_gemm(x.to(e4), w.to(e4), None, regions, geometry, 8, [xs, ws], "
     "bf16, [])",
     "x's block-scale tensor is not 16-byte aligned"),
    ("fit_gemm one x scale, two of the weight",
     "e4 = torch.float8_e4m3fn\n"
     "xs, ws = torch.ones(1, 1, device=dev), torch.ones(2, device=dev)\n"
     "torch.ops.tokenweave.fit_gemm(x.to(e4), w.to(e4), None, regions, geometry, 8, [xs, ws], "
     "bf16, [])",
     "x's one scale is per tensor, so the weight's must be one float32 too; got 2"),
    ("fit_gemm an empty x scale",
     "e4, one = torch.float8_e4m3fn, torch.ones(1, device=dev)\n"
     "torch.ops.tokenweave.fit_gemm(x.to(e4), w.to(e4), None, regions, geometry, 8, "
     "[torch.ones(0, device=dev), one], bf16, [])",
     "x's scale_inv is empty"),
    ("fit_gemm block scales, block rows 216",
     "e4 = torch.float8_e4m3fn\n"
     "xs, ws = torch.ones(32, 256, device=dev), torch.ones(8, 32, device=dev)\n"
     "geometry[9] = 216\n"
     "torch.ops.tokenweave.fit_gemm(x.to(e4), w.to(e4), None, regions, geometry, 8, [xs, ws], "
     "bf16, [])",
     "in 16..208 (block scales), got 216"),
    ("fit_gemm tokens as M, weight rows 200",
     "e4 = torch.float8_e4m3fn\n"
     "xs, ws = torch.ones(32, 256, device=dev), torch.ones(8, 32, device=dev)\n"
     "geometry[9:11], geometry[12] = [128, 1], 200\n"
     "torch.ops.tokenweave.fit_gemm(x.to(e4), w.to(e4), None, regions, geometry, 8, [xs, ws], "
     "bf16, [])",
     "got weight_rows 200, block_rows 128"),
    ("fit_gemm tokens as M, scales per tensor",
     "e4, one = torch.float8_e4m3fn, torch.ones(1, device=dev)\n"
     "geometry[12] = 128\n"
     "torch.ops.tokenweave.fit_gemm(x.to(e4), w.to(e4), None, regions, geometry, 8, [one, one], "
     "bf16, [])",
     "got weight_rows 128, block_rows 64, no block scales"),
]


@pytest.mark.parametrize("case, call, message", CASES, ids=[c[0].replace(" ", "-") for c in CASES])
def test_op_check_raises_its_message(case, call, message):
    kernels_or_skip()
    if case.startswith("fit_gemm"):
        from megatron_tokenweave.kernels._ext import fitted_gemm_available

        if not fitted_gemm_available(torch.device("cuda", 0)):
            pytest.skip("fit_gemm needs an sm_90 GPU")
    script = (_PRELUDE + "try:\n" + "".join(f"    {line}\n" for line in call.split("\n"))
              + "except RuntimeError as exc:\n    print('RAISED', str(exc).splitlines()[0])\n"
              + "else:\n    print('NO ERROR')\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, (f"{case}: the process ended with {run.returncode}: "
                                 f"{run.stderr[-2000:]}")
    assert "RAISED" in run.stdout and message in run.stdout, f"{case}: {run.stdout!r}"
