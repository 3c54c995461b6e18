"""compute-sanitizer memcheck and racecheck are clean on a small 2-rank run of the kernel (on 2
GPUs, or both ranks sharing one).

racecheck leaves out the ping-pong GEMM kernel (kernels/owner_gemm_pingpong.py): it reports
hazards only in the dispatch code Triton's Gluon generates for warp-specialized partitions (the
worker warps' one-byte partition ids, written by the default warps before dispatch and after
the join, read by each worker after a CTA barrier), attributed to the kernel's first and last
lines (Triton 3.6, docs/kernel.md). memcheck covers it; the one-consumer GEMM kernel and the
consumer stay under both tools."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from megatron_tokenweave.launch import NO_MULTICAST_ENV, free_port

CASE = os.path.join(os.path.dirname(__file__), "_sanitize_case.py")
pytestmark = pytest.mark.skipif(
    torch.cuda.device_count() < 1 or shutil.which("compute-sanitizer") is None,
    reason="needs a GPU and compute-sanitizer",
)


@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_kernel_is_sanitizer_clean(tool):
    from megatron_tokenweave import kernels

    kernels.load_extension()  # build (if needed) outside the sanitizer
    env = {**os.environ, **NO_MULTICAST_ENV, "TOKENWEAVE_KERNEL_TIMEOUT_S": "300"}
    skip = ["--kernel-name-exclude", "kns=_pingpong_kernel"] if tool == "racecheck" else []
    cmd = ["compute-sanitizer", f"--tool={tool}", "--target-processes=all", *skip,
           "--error-exitcode=99", sys.executable, CASE, str(free_port())]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=540)
    tail = (proc.stdout + proc.stderr)[-3000:]
    # --error-exitcode: any memcheck error or racecheck hazard makes the exit code 99.
    assert proc.returncode == 0, tail
    assert "sanitize case: ok" in proc.stdout, tail
    report = proc.stdout + proc.stderr
    if tool == "memcheck":
        assert "ERROR SUMMARY: 0 errors" in report, tail
    else:  # racecheck prints a summary only when it found hazards
        assert "hazard" not in report.lower() or "0 hazards" in report, tail
