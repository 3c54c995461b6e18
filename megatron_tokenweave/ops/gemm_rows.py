"""Operand rows that the communicating GEMM's TMA reads at full speed.

Both GEMM kernels (the Triton ones and the fitted CUDA one) read x and the weight with TMA, a
box of 128 bytes of each row per pipeline stage. Where a row's bytes are an odd multiple of 16,
every other row starts half way into a 32-byte sector: e4m3 rows of K = 3696 (Qwen2.5-72B's fc2
at TP 8) ran the fitted kernel at 1.7x and the Triton one at 1.4x their time at K = 3680 or
3712, while cuBLAS's FP8 GEMM kept its pace (one H100, docs/kernel.md "Row pitch"). The kernels
take a row pitch (the view's stride), so `PaddedRows` hands such an operand over in rows padded
to a multiple of 128 bytes: one copy into a buffer it keeps, moved in 8-byte words (a
byte-wise strided copy of 16K e4m3 rows of that shard took 155 us on one H100, a word-wise one
48 us, the GEMM 760 us: docs/kernel.md "Row pitch").
"""

from __future__ import annotations

import torch

SECTOR_BYTES = 32  # rows a multiple of this apart read at full speed
PITCH_BYTES = 128  # the padded rows' pitch: whole TMA boxes
WORD = torch.int64  # the copy's unit


def needs_padding(t: torch.Tensor) -> bool:
    """Whether t's rows start off a 32-byte sector (their pitch an odd multiple of 16 bytes)."""
    return t.stride(0) * t.element_size() % SECTOR_BYTES != 0


def padded_pitch(k: int, element_size: int) -> int:
    """Elements between two padded rows of k elements: k's bytes rounded up to PITCH_BYTES."""
    return -(-k * element_size // PITCH_BYTES) * PITCH_BYTES // element_size


def whole_boxes(k: int, element_size: int) -> bool:
    """Whether contiguous rows of k elements reach the GEMM (padded where `needs_padding`
    says) a whole number of 128-byte TMA boxes apart."""
    pitch = k * element_size
    if pitch % SECTOR_BYTES:
        pitch = padded_pitch(k, element_size) * element_size
    return pitch % PITCH_BYTES == 0


class PaddedRows:
    """One operand's padded rows, kept between calls: `__call__(t)` is t itself where its rows
    read at full speed, else a [rows, K] view of a buffer at `padded_pitch` holding t's values.
    The buffer is made at the first call that needs it and again only for more rows or another
    dtype or width (so a CUDA graph captured after an eager call of its size allocates none)."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None
        self._source: tuple[int, int] | None = None  # (data pointer, rows) the buffer holds

    def __call__(self, t: torch.Tensor, changed: bool = True) -> torch.Tensor:
        """t in rows that read at full speed. changed=False: the caller knows t's values are
        those of the last call (a cached FP8 weight), so the same tensor is not copied again."""
        if t.dim() != 2 or not needs_padding(t):
            return t
        rows, k = t.shape
        pitch = padded_pitch(k, t.element_size())
        buf = self._buf
        if (buf is None or buf.shape[0] < rows or buf.shape[1] != pitch or buf.dtype != t.dtype
                or buf.device != t.device):
            buf = self._buf = torch.empty(rows, pitch, dtype=t.dtype, device=t.device)
            self._source = None
        out = buf[:rows, :k]
        source = (t.data_ptr(), rows)
        if changed or self._source != source:
            _copy_rows(out, t)
            self._source = source
        return out


def _copy_rows(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst = src bit for bit (`copy_views`)."""
    d, s = copy_views(dst, src)
    d.copy_(s)


def copy_views(dst: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The views a copy of src into dst moves: 8-byte words where both tensors' rows are
    contiguous and their widths, pitches and addresses divide into words, else bytes where
    their rows are contiguous (no float8 kernel either way), else the tensors themselves."""
    if dst.stride(-1) != 1 or src.stride(-1) != 1:
        return dst, src
    d, s = dst.view(torch.uint8), src.view(torch.uint8)
    size = WORD.itemsize
    if all(b.shape[1] % size == 0 and b.stride(0) % size == 0 and b.data_ptr() % size == 0
           for b in (d, s)):
        return d.view(WORD), s.view(WORD)
    return d, s
