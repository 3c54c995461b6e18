"""FP8 operands of the communicating GEMM (the GEMM-fused mechanism under an FP8 recipe).

The row-parallel GEMM takes x [rows, K] and weight [N, K] in e4m3, as TE's quantizers leave
them (the rowwise data), and their dequantization scales in one of two forms:

- per tensor (delayed and current scaling): one fp32 scale_inv each, [1]; the kernel multiplies
  the fp32 accumulator by their product once per tile, before the bias and the one rounding;
- blocks (TE's blockwise recipe on Hopper): x in 1 x 128 blocks, scale_inv [ceil(K / 128),
  round_up(rows, 4)] (block kb of row r at [kb, r]), weight in 128 x 128 blocks, scale_inv
  [ceil(N / 128), round_up(ceil(K / 128), 4)] (TE's GEMM-ready layouts); each K block's
  product is scaled by its row's and column's scales before it is accumulated. A last block
  short of 128 (K = 3696: Qwen2.5-72B's fc2 at TP 8) has its own scales, as TE quantizes it;
  the kernels' loads fill the columns past K with zeros, which add nothing.

`dequantized` is the definition the kernel is checked against and the form the CPU backend
computes with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_tokenweave.ops.fp8_rows import BLOCK_COLS, FP8_DTYPE, scale_stride
from megatron_tokenweave.ops.validate import VECTOR_BYTES, TokenWeaveInputError


@dataclass(frozen=True)
class Fp8Operands:
    """The scales of an FP8 call's x and weight (module docstring)."""

    x_scale_inv: torch.Tensor
    w_scale_inv: torch.Tensor
    blocks: bool = False

    @property
    def scaling(self) -> str:
        """The scales' form, as the tile pick takes it (ops/segments.FP8_SCALINGS)."""
        return "blocks" if self.blocks else "tensor"

    def shapes(self, rows: int, n: int, k: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The scales' shapes for x [rows, K] and weight [N, K]."""
        if not self.blocks:
            return (1,), (1,)
        kb = -(-k // BLOCK_COLS)
        return (kb, scale_stride(rows)), (-(-n // BLOCK_COLS), scale_stride(kb))

    def check(self, x: torch.Tensor, weight: torch.Tensor) -> None:
        """Raise TokenWeaveInputError unless x and weight are e4m3 with scales of this form."""
        if x.dtype != FP8_DTYPE or weight.dtype != FP8_DTYPE:
            raise TokenWeaveInputError(
                f"FP8 operands are {FP8_DTYPE}, got x {x.dtype} and weight {weight.dtype}")
        n, k = weight.shape
        want = self.shapes(x.shape[0], n, k)
        for name, s, shape in zip(("x", "weight"), (self.x_scale_inv, self.w_scale_inv), want,
                                  strict=True):
            if s.dtype != torch.float32 or tuple(s.shape) != shape or not s.is_contiguous() \
                    or s.device != x.device:
                raise TokenWeaveInputError(
                    f"the {name} scale_inv must be a contiguous float32 {shape} tensor on "
                    f"{x.device}, got {s.dtype} {tuple(s.shape)} on {s.device}")
        if self.blocks and self.x_scale_inv.data_ptr() % VECTOR_BYTES:
            # The fitted kernel loads x's block scales by TMA, from a 16-byte-aligned base.
            raise TokenWeaveInputError(
                f"the x block scale_inv must start {VECTOR_BYTES}-byte aligned, got address "
                f"{self.x_scale_inv.data_ptr():#x}")

    def dequantized(self, x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor,
                                                                          torch.Tensor]:
        """x and weight in fp32, their scales applied."""
        xf, wf = x.float(), weight.float()
        if not self.blocks:
            return xf * self.x_scale_inv, wf * self.w_scale_inv
        rows, k = x.shape
        n = weight.shape[0]
        kb = -(-k // BLOCK_COLS)
        xs = self.x_scale_inv[:, :rows].t().repeat_interleave(BLOCK_COLS, dim=1)[:, :k]
        ws = self.w_scale_inv[:, :kb].repeat_interleave(BLOCK_COLS, dim=0)[:n]
        return xf * xs, wf * ws.repeat_interleave(BLOCK_COLS, dim=1)[:, :k]
