"""The CUTLASS reference GEMMs of `bench gemm_fused --cutlass` (bench/cutlass_gemm.py) compute
x @ W^T: every configuration (schedules, tile and cluster shapes) against an fp32 product on
random bf16 inputs, row counts that are not tile multiples, outputs poisoned first. Skips
without an sm_90 GPU or the nvidia-cutlass package; the first run builds the configurations
(minutes)."""

from __future__ import annotations

import pytest
import torch


def _load():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm_90 GPU")
    pytest.importorskip("cutlass_library", reason="nvidia-cutlass is not installed")
    from megatron_tokenweave.bench import cutlass_gemm

    cutlass_gemm.load()
    return cutlass_gemm


@pytest.mark.parametrize(("rows", "k", "n"), [(1, 1024, 4096), (100, 1792, 4096),
                                              (1031, 3584, 8192), (4096, 1024, 5120)])
def test_every_configuration_computes_x_times_w_transposed(rows, k, n):
    cutlass_gemm = _load()
    g = torch.Generator(device="cuda").manual_seed(rows + k)
    x = torch.randn(rows, k, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=g) * k**-0.5).to(torch.bfloat16)
    want = x.float() @ w.float().t()
    for name in cutlass_gemm.CONFIGS:
        out = torch.full((rows, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        cutlass_gemm.gemm(name)(x, w, out)
        torch.cuda.synchronize()
        assert not out.isnan().any(), f"{name}: rows left unwritten"
        torch.testing.assert_close(out.float(), want, rtol=1.6e-2, atol=1e-2,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_bad_operands_are_a_python_error():
    cutlass_gemm = _load()
    run = cutlass_gemm.gemm("coop_128x256_c1x1")
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="bf16"):
        run(x.half(), w, torch.empty(64, 4096, device="cuda", dtype=torch.bfloat16))
    out = torch.empty(64, 4096, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"\[N, K\]"):
        run(x, w[:, :512].contiguous(), out)
    with pytest.raises(RuntimeError, match=r"CUDA matrix \[N, K\]"):
        run(x, w.cpu(), out)
    with pytest.raises(RuntimeError, match=r"\[M, N\]"):
        run(x, w, out.view(64, 64, 64))
    shifted = torch.empty(64 * 1024 + 1, device="cuda", dtype=torch.bfloat16)[1:].view(64, 1024)
    with pytest.raises(RuntimeError, match="16-byte aligned"):
        run(shifted, w, out)
