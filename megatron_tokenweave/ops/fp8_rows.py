"""FP8 normed rows: the fused op's normed output already quantized for the next linear.

Where the linear after the fused op runs TE's FP8 GEMM, its input quantizer would read the
normed rows back and quantize them. The op holds each row in registers, so it writes the e4m3
rows and their scales itself, exactly as that quantizer quantizes the same rows rounded to the
activations' dtype (csrc/include/tokenweave/fp8_rows.cuh; `quantize` here is the definition,
which every backend runs or matches bit for bit):

- `tensor_scaled`: one known scale (delayed scaling): q = e4m3(x * scale), saturating; the max
  of |x| accumulated into the quantizer's amax; scale_inv = 1 / scale.
- `blockwise`: 1 x 128 blocks (blockwise scaling of activations): each block of a row gets
  scale = 448 / amax(block) (amax floored at `amax_eps`; 1 for an all-zero block; the dtype's
  largest finite value where the division overflows; rounded down to a power of two where
  `pow2`), scale_inv at [block, row] of a [hidden / 128, round_up(rows, 4)] tensor (TE's
  GEMM-ready layout).

Current (tensorwise) scaling is not written here: its scale is the amax of all rows of the call,
known only after the last row is normed, which a one-pass op cannot have (the woven layer leaves
those rows to TE's quantizer). Replicated layout only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_tokenweave.ops.validate import TokenWeaveInputError

FP8_DTYPE = torch.float8_e4m3fn
E4M3_MAX = 448.0
BLOCK_COLS = 128
SCALE_ROWS = 4  # block scales' rows are padded to a multiple of this (TE's GEMM layout)


def scale_stride(rows: int) -> int:
    """Entries between two column blocks' scales: the rows rounded up to 4."""
    return -(-rows // SCALE_ROWS) * SCALE_ROWS


@dataclass(frozen=True)
class Fp8Rows:
    """Where the fused op writes its normed rows in FP8: `data` [1, rows, hidden] e4m3 and the
    scales of one of the two scalings (module docstring)."""

    data: torch.Tensor
    scale_inv: torch.Tensor  # tensor scale: [1]; blocks: [hidden / 128, round_up(rows, 4)]
    scale: torch.Tensor | None = None  # tensor scale: the known scale [1]; None: 1 x 128 blocks
    amax: torch.Tensor | None = None  # tensor scale: [1], max |x| accumulated into it
    amax_eps: float = 0.0
    pow2: bool = False

    @classmethod
    def tensor_scaled(cls, data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor,
                      scale_inv: torch.Tensor) -> Fp8Rows:
        return cls(data, scale_inv, scale, amax)

    @classmethod
    def blockwise(cls, data: torch.Tensor, scale_inv: torch.Tensor, amax_eps: float = 0.0,
                  pow2: bool = True) -> Fp8Rows:
        return cls(data, scale_inv, amax_eps=float(amax_eps), pow2=bool(pow2))

    @property
    def blocks(self) -> bool:
        return self.scale is None

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def op_args(self) -> tuple[list[torch.Tensor], list[float]]:
        """The CUDA op's `normed_scales` and `scaling` (csrc/ops.cu fp8_rows_of)."""
        if self.blocks:
            return [self.scale_inv], [2.0, self.amax_eps, float(self.pow2)]
        return [self.scale, self.amax, self.scale_inv], [1.0]

    def check(self, rows: int, hidden: int, device: torch.device) -> None:
        """Raise TokenWeaveInputError unless these can hold `rows` normed rows of `hidden`."""
        if self.data.dtype != FP8_DTYPE or tuple(self.data.shape) != (1, rows, hidden) \
                or not self.data.is_contiguous():
            raise TokenWeaveInputError(
                f"FP8 normed rows must be a contiguous [1, {rows}, {hidden}] {FP8_DTYPE} tensor, "
                f"got {tuple(self.data.shape)} {self.data.dtype}")
        scales = [self.scale_inv] + ([] if self.blocks else [self.scale, self.amax])
        for t in scales:
            if t.dtype != torch.float32 or t.device != device or not t.is_contiguous():
                raise TokenWeaveInputError(
                    f"FP8 scales must be contiguous fp32 tensors on {device}, got {t.dtype} on "
                    f"{t.device}")
        if self.data.device != device:
            raise TokenWeaveInputError(f"FP8 normed rows are on {self.data.device}, not {device}")
        if not self.blocks:
            if any(t.numel() != 1 for t in scales):
                raise TokenWeaveInputError("a tensor scale, its amax and its scale_inv are one "
                                           "element each")
            return
        if hidden % BLOCK_COLS:
            raise TokenWeaveInputError(
                f"1 x {BLOCK_COLS} block scales need hidden a multiple of {BLOCK_COLS}, got "
                f"{hidden}")
        want = (hidden // BLOCK_COLS, scale_stride(rows))
        if tuple(self.scale_inv.shape) != want:
            raise TokenWeaveInputError(
                f"block scale_inv must be {want} for {rows} rows, got "
                f"{tuple(self.scale_inv.shape)}")

    def quantize(self, normed: torch.Tensor) -> None:
        """Write the rows `normed` [rows, hidden] (the activations' dtype) in this scaling: the
        definition every backend of the op meets."""
        x = normed.float()
        rows, hidden = x.shape
        if not self.blocks:
            self.amax.copy_(torch.maximum(self.amax, x.abs().amax().reshape(1)))
            self.scale_inv.copy_(torch.reciprocal(self.scale))
            self.data[0].copy_(_to_e4m3(x * self.scale))
            return
        blocks = x.view(rows, hidden // BLOCK_COLS, BLOCK_COLS)
        scale = block_scales(blocks.abs().amax(dim=-1), self.amax_eps, self.pow2, normed.dtype)
        self.data[0].copy_(_to_e4m3(blocks * scale.unsqueeze(-1)).view(rows, hidden))
        self.scale_inv[:, :rows].copy_(torch.reciprocal(scale).t())


def write_replicated(normed_out: torch.Tensor | Fp8Rows, normed: torch.Tensor) -> None:
    """The replicated layout's normed rows [rows, hidden] into the op's destination: rows in the
    activations' dtype, or FP8 rows."""
    if isinstance(normed_out, Fp8Rows):
        normed_out.quantize(normed)
    else:
        normed_out[0].copy_(normed)


def block_scales(amax: torch.Tensor, amax_eps: float, pow2: bool,
                 dtype: torch.dtype) -> torch.Tensor:
    """Each block's scale from its amax (fp32), as TE's quantizer computes it."""
    amax = torch.clamp(amax, min=amax_eps) if amax_eps > 0 else amax
    scale = torch.div(torch.full_like(amax, E4M3_MAX), amax)  # one rounding (not 1/x * 448)
    scale = torch.where(torch.isinf(scale), torch.finfo(dtype).max, scale)
    scale = torch.where((amax == 0) | torch.isinf(amax) | torch.isnan(amax), 1.0, scale)
    if pow2:
        scale = (scale.view(torch.int32) & -0x800000).view(torch.float32)
    return scale


def _to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """e4m3 as the cvt.rn.satfinite instruction rounds: to nearest, ties to even, subnormals
    kept (steps of 2^-9 below 2^-6), saturated to +-448 (NaN stays NaN). The rounding is done
    here in fp32, exactly (a scaled power-of-two step), so the result is representable and the
    final cast only changes the storage."""
    mag = torch.clamp(x.abs(), max=E4M3_MAX)
    _, exp = torch.frexp(mag)  # mag = f * 2^exp, f in [0.5, 1)
    step = torch.ldexp(torch.ones_like(mag), torch.clamp(exp - 4, min=-9))  # 3 mantissa bits
    rounded = torch.round(mag / step) * step  # torch.round: half to even
    return torch.copysign(torch.clamp(rounded, max=E4M3_MAX), x).to(FP8_DTYPE)
