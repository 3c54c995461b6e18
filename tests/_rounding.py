"""What rounding allows when a kernel's result is compared with torch's: outputs built from
GEMM partial sums (the GEMM-fused path) may differ from torch's by one unit in the last place of
any rank's partial sum, since the kernel's and torch's fp32 accumulation orders can round a
partial sum to neighbouring values; no tolerance in relative terms models that near zero."""

from __future__ import annotations

import torch


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of |x| in `dtype` (bf16: 8 significant bits, fp16: 11)."""
    bits = 8 if dtype == torch.bfloat16 else 11
    _, exponent = torch.frexp(x.abs())
    return torch.ldexp(torch.ones_like(x), exponent - bits)


def within(got: torch.Tensor, want: torch.Tensor, slack: torch.Tensor, what: str) -> None:
    """|got - want| within `slack` (one ulp of every rank's partial sum and of the result)
    plus 1e-4; the message locates the worst miss and says how far beyond rounding it is (mixed
    rows of two calls miss by the size of the values, a rounding miss by about an ulp)."""
    err = (got - want).abs()
    excess = err - slack - 1e-4
    bad = int((excess > 0).sum())
    if bad:
        flat = int(excess.argmax())
        row, col = divmod(flat, got.shape[-1])
        raise AssertionError(
            f"{what}: {bad} of {got.numel()} values beyond rounding; worst at row {row} col "
            f"{col}: got {got.view(-1)[flat].item():.6f}, want {want.view(-1)[flat].item():.6f}, "
            f"slack {slack.view(-1)[flat].item():.2e}; max |err| {err.max().item():.3e}")
