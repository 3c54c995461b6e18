"""ops/gemm_rows.py: operands handed to the communicating GEMM in rows whose pitch is a whole
number of 32-byte sectors (padded to 128 bytes where theirs is not), values unchanged."""

from __future__ import annotations

import pytest
import torch

from megatron_tokenweave.ops.fp8_rows import FP8_DTYPE
from megatron_tokenweave.ops.gemm_rows import (
    PITCH_BYTES,
    PaddedRows,
    copy_views,
    needs_padding,
    padded_pitch,
    whole_boxes,
)
from megatron_tokenweave.ops.validate import TokenWeaveInputError, check_gemm_operands


def _e4m3(rows: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)).to(FP8_DTYPE)


@pytest.mark.parametrize("k,esize,padded", [(3696, 1, True), (3584, 1, False), (3680, 1, False),
                                            (1848, 2, True), (1856, 2, False), (24, 4, False),
                                            (28, 4, True)])
def test_needs_padding_where_rows_start_off_a_sector(k, esize, padded):
    dtype = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32}[esize]
    assert needs_padding(torch.empty(3, k, dtype=dtype)) is padded
    pitch = padded_pitch(k, esize)
    assert pitch >= k and pitch * esize % PITCH_BYTES == 0 and (pitch - k) * esize < PITCH_BYTES


@pytest.mark.parametrize("rows", [1, 7, 513])
def test_padded_rows_hold_the_values_at_a_whole_sector_pitch(rows):
    """e4m3 rows of K = 3696 (3696 bytes: 16 past a sector) come back as a view of padded rows,
    bit-identical, that the GEMM's operand check takes; rows already aligned come back as they
    are."""
    pad = PaddedRows()
    x = _e4m3(rows, 3696, rows)
    got = pad(x)
    assert got.shape == x.shape and got.stride() == (3712, 1) and not needs_padding(got)
    assert torch.equal(got.view(torch.uint8), x.view(torch.uint8))
    check_gemm_operands(got, _e4m3(16, 3696, 0), "test")
    aligned = _e4m3(rows, 3584, rows)
    assert pad(aligned) is aligned


def test_padded_rows_keep_their_buffer_and_copy_what_changed():
    """One buffer across calls (no allocation once sized), grown for more rows; a weight known
    unchanged (changed=False) is not copied again, but another tensor always is."""
    pad = PaddedRows()
    a = _e4m3(64, 3696, 1)
    first = pad(a)
    b = _e4m3(32, 3696, 2)
    second = pad(b)
    assert second.data_ptr() == first.data_ptr()
    assert torch.equal(second.view(torch.uint8), b.view(torch.uint8))
    # the same tensor, its values changed behind the caller's back: changed=False keeps the copy
    again = pad(b, changed=True)
    b.view(torch.uint8).add_(1)
    kept = pad(b, changed=False)
    assert kept.data_ptr() == again.data_ptr()
    assert not torch.equal(kept.view(torch.uint8), b.view(torch.uint8))
    assert torch.equal(pad(b).view(torch.uint8), b.view(torch.uint8))
    # another tensor with changed=False is still copied
    c = _e4m3(32, 3696, 3)
    assert torch.equal(pad(c, changed=False).view(torch.uint8), c.view(torch.uint8))
    grown = pad(_e4m3(100, 3696, 4))
    assert grown.shape == (100, 3696)


def test_gemm_operand_check_refuses_rows_the_kernels_cannot_read():
    x, w = torch.randn(8, 24), torch.randn(16, 24)
    for bad, match in ((torch.randn(24, 8).t(), "contiguous"), (torch.randn(8, 25)[:, :24],
                                                                "16 bytes apart"),
                       (torch.randn(8, 24, 2)[..., 0], "contiguous"), (torch.randn(24), "2-D")):
        with pytest.raises(TokenWeaveInputError, match=match):
            check_gemm_operands(bad, w, "test")
    check_gemm_operands(torch.randn(8, 28)[:, :24], w, "test")
    check_gemm_operands(x, w, "test")


@pytest.mark.parametrize("start,k,step,unit", [(0, 3696, 1, torch.int64),
                                               (8, 3696, 1, torch.int64),
                                               (1, 3696, 1, torch.uint8),
                                               (0, 3693, 1, torch.uint8),
                                               (0, 1848, 2, None)])
def test_padded_rows_copy_any_source_exactly(start, k, step, unit):
    """Sources the copy moves in 8-byte words (rows, pitch and start divisible), byte by byte
    (a start one byte in, an odd width) or element by element (rows not contiguous) come back
    bit-identical, each moved in the unit named."""
    base = _e4m3(9, 8016, start + k)  # rows 16 bytes past a sector apart: padded
    x = base[:, start:start + k * step:step]
    pad = PaddedRows()
    got = pad(x)
    assert got.shape == x.shape and got.stride() == (padded_pitch(k, 1), 1)
    assert torch.equal(got.view(torch.uint8), x.contiguous().view(torch.uint8))
    d, s = copy_views(got, x)
    assert d.dtype == s.dtype == (unit or x.dtype)


@pytest.mark.parametrize("k,esize,whole", [(3584, 1, True), (3696, 1, True), (7392, 1, False),
                                           (14784, 1, False), (2368, 1, False), (1848, 2, True),
                                           (3696, 2, False)])
def test_whole_boxes_as_the_gemm_gets_the_rows(k, esize, whole):
    """Rows of k elements are whole 128-byte boxes apart as handed over: 3696 e4m3 bytes are
    padded to 3712 (29 boxes); 7392 bytes are on a sector, so not padded, 57.75 boxes."""
    assert whole_boxes(k, esize) is whole
