"""FP8 normed rows (ops.fp8_rows) on CPU: the reference quantization's properties on random rows,
its argument checks, and the fused op writing FP8 rows on the reference and collectives
mechanisms and the GEMM-fused consumer (its emulation; 2 gloo ranks) equal, bit for bit, to
the quantization of the same call's rows in the activations' dtype. The CUDA kernels' rows are
checked against this reference (and TE's quantizers) in tests/gpu/test_fp8_rows_gpu.py and
tests/gpu/test_gemm_fused.py."""

from __future__ import annotations

import itertools

import pytest
import torch
from _dist import run_ranks

from megatron_tokenweave.ops import Layout
from megatron_tokenweave.ops.fp8_rows import (
    E4M3_MAX,
    FP8_DTYPE,
    Fp8Rows,
    _to_e4m3,
    block_scales,
    scale_stride,
)
from megatron_tokenweave.ops.segments import segments
from megatron_tokenweave.ops.validate import TokenWeaveInputError, check_fused_args

EPS = 1e-5


def _blocks(rows: int, hidden: int, pow2: bool = True, amax_eps: float = 0.0) -> Fp8Rows:
    data = torch.full((1, rows, hidden), 0x7F, dtype=torch.uint8).view(FP8_DTYPE)
    return Fp8Rows.blockwise(data, torch.full((hidden // 128, scale_stride(rows)), float("nan")),
                             amax_eps=amax_eps, pow2=pow2)


def _tensor(rows: int, hidden: int, scale: float, amax: float) -> Fp8Rows:
    data = torch.full((1, rows, hidden), 0x7F, dtype=torch.uint8).view(FP8_DTYPE)
    return Fp8Rows.tensor_scaled(data, torch.tensor([scale]), torch.tensor([amax]),
                                 torch.tensor([float("nan")]))


@pytest.mark.parametrize("rows,hidden,pow2,dtype", list(itertools.product(
    (1, 5, 33), (128, 384), (True, False), (torch.bfloat16, torch.float16))))
def test_blockwise_reference_dequantizes_within_e4m3_rounding(rows, hidden, pow2, dtype):
    g = torch.Generator().manual_seed(rows * 1000 + hidden)
    x = (torch.randn(rows, hidden, generator=g) * torch.rand(rows, 1, generator=g) * 8).to(dtype)
    fp8 = _blocks(rows, hidden, pow2)
    fp8.quantize(x)
    sinv = fp8.scale_inv[:, :rows].t()  # [rows, blocks]
    assert torch.isnan(fp8.scale_inv[:, rows:]).all(), "the scales' padding rows are not written"
    q = fp8.data[0].float().view(rows, hidden // 128, 128)
    deq = q * sinv.unsqueeze(-1)
    xf = x.float().view(rows, hidden // 128, 128)
    # e4m3 keeps 3 mantissa bits: half an ulp is 1/16 of the value; subnormals 2^-10 absolute.
    bound = xf.abs() / 16 + sinv.unsqueeze(-1) * 2.0 ** -10
    assert ((deq - xf).abs() <= bound).all()
    top = q.abs().amax(-1)
    assert (top <= E4M3_MAX).all()
    assert (top >= (E4M3_MAX / 2 if pow2 else E4M3_MAX * 0.99)).all(), "scales use the range"
    if pow2:
        m, _ = torch.frexp(sinv)
        assert (m == 0.5).all(), "power-of-two scales"


def test_blockwise_reference_zero_block_and_eps_floor():
    x = torch.randn(3, 256).to(torch.bfloat16)
    x[1, 128:] = 0
    fp8 = _blocks(3, 256)
    fp8.quantize(x)
    assert fp8.scale_inv[1, 1] == 1.0 and (fp8.data[0, 1, 128:].float() == 0).all()
    floored = _blocks(3, 256, pow2=False, amax_eps=1e3)
    floored.quantize(x)
    assert torch.allclose(floored.scale_inv[:, :3], torch.full((2, 3), 1e3 / E4M3_MAX))
    scale = block_scales(torch.tensor([0.0, float("inf"), 1e-40, 2.0]), 0.0, False, torch.bfloat16)
    assert scale.tolist()[:2] == [1.0, 1.0] and scale[2] == torch.finfo(torch.bfloat16).max
    assert scale[3] == E4M3_MAX / 2


def test_tensor_scaled_reference_accumulates_amax_and_saturates():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 136, generator=g).to(torch.bfloat16)
    amax = x.float().abs().max().item()
    fp8 = _tensor(7, 136, scale=1000.0, amax=0.125)  # saturates: |x| * 1000 > 448
    fp8.quantize(x)
    assert fp8.amax.item() == amax and fp8.scale_inv.item() == pytest.approx(1e-3)
    q = fp8.data[0].float()
    assert not torch.isnan(q).any() and q.abs().max() == E4M3_MAX
    later = Fp8Rows.tensor_scaled(fp8.data[:, :2], fp8.scale, fp8.amax, fp8.scale_inv)
    later.quantize(x[:2] * 0.5)  # a later call below the recorded amax keeps it
    assert fp8.amax.item() == amax


def test_fp8_rows_are_checked():
    partial, residual, weight = torch.randn(1, 4, 256), torch.randn(4, 256), torch.randn(256)
    partial, residual, weight = (t.to(torch.bfloat16) for t in (partial, residual, weight))

    def check(normed, layout=Layout.REPLICATED, p=partial):
        check_fused_args(p, residual, weight, residual.clone(), normed, layout, 2)

    check(_blocks(4, 256))
    check(_tensor(4, 256, 1.0, 0.0))
    bad = {
        "replicated layout": lambda: check(_blocks(4, 256), Layout.SEQUENCE_PARALLEL,
                                           partial.expand(2, 4, 256).contiguous()),
        "contiguous": lambda: check(Fp8Rows.blockwise(
            torch.zeros(1, 4, 256, dtype=torch.uint8), torch.zeros(2, 4))),
        "block scale_inv must be": lambda: check(Fp8Rows.blockwise(
            _blocks(4, 256).data, torch.zeros(2, 5))),
        "fp32": lambda: check(Fp8Rows.blockwise(
            _blocks(4, 256).data, torch.zeros(2, 4, dtype=torch.float16))),
        "one element": lambda: check(Fp8Rows.tensor_scaled(
            _blocks(4, 256).data, torch.ones(2), torch.zeros(1), torch.zeros(1))),
    }
    for needle, call in bad.items():
        with pytest.raises(TokenWeaveInputError, match=needle):
            call()
    p136 = torch.randn(1, 4, 136).to(torch.bfloat16)
    with pytest.raises(TokenWeaveInputError, match="multiple of 128"):
        check_fused_args(p136, residual[:, :136].contiguous(), weight[:136].contiguous(),
                         residual[:, :136].contiguous(), Fp8Rows.blockwise(
                             torch.zeros(1, 4, 136, dtype=torch.uint8).view(FP8_DTYPE),
                             torch.zeros(1, 4)), Layout.REPLICATED, 2)


def _op_worker(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

    from megatron_tokenweave.communicator import Communicator

    failures = []
    for index, (n, hidden, dtype, comm) in enumerate(itertools.product(
            (1, 3, 17), (128, 256), (torch.bfloat16, torch.float16),
            ("fused", "collectives", "gemm"))):
        gen = torch.Generator().manual_seed(50 + index)
        partials = torch.randn(world, 1, n, hidden, generator=gen).to(dtype)
        residual = torch.randn(n, hidden, generator=gen).to(dtype)
        weight = (1 + 0.3 * torch.randn(hidden, generator=gen)).to(dtype)
        ws = Communicator(dist.group.WORLD, n, hidden, dtype, torch.device("cpu"), "reference")
        seg = None
        if comm == "gemm":  # the GEMM-fused consumer: partial sums of x @ w^T in the inbox
            ws.prepare_gemm()
            x = torch.randn(world, n, 64, generator=gen).to(dtype)[rank]
            w = (torch.randn(world, hidden, 64, generator=gen) / 8).to(dtype)[rank]
            seg = segments(Layout.REPLICATED, world, n, hidden=hidden, k=64, ctas=1)
        outs = []
        for normed in (torch.full((1, n, hidden), float("nan"), dtype=dtype),
                       _blocks(n, hidden), _tensor(n, hidden, 3.0, 0.5)):
            partial = ws.partial[:n].view(1, n, hidden)
            partial.copy_(partials[rank])
            if seg is not None:
                ws.row_gemm(x, w, None, seg, 0, ctas=1)
            res = torch.full_like(residual, float("nan"))
            ws.allreduce_rmsnorm(partial, residual, weight, EPS, res, normed, Layout.REPLICATED,
                                 comm=comm, segments=seg)
            outs.append((res, normed))
        (res_t, normed_t), *fp8s = outs
        for res, rows in fp8s:
            ref = _blocks(n, hidden) if rows.blocks else _tensor(n, hidden, 3.0, 0.5)
            ref.quantize(normed_t[0])
            same = (torch.equal(res, res_t)
                    and torch.equal(rows.data.view(torch.uint8), ref.data.view(torch.uint8))
                    and torch.equal(rows.scale_inv[:, :n] if rows.blocks else rows.scale_inv,
                                    ref.scale_inv[:, :n] if rows.blocks else ref.scale_inv)
                    and (rows.blocks or torch.equal(rows.amax, ref.amax)))
            if not same:
                failures.append(f"rank {rank} n={n} H={hidden} {dtype} {comm} "
                                f"{'blocks' if rows.blocks else 'tensor'}")
    return failures


def test_fused_op_writes_fp8_rows_on_the_reference_mechanisms():
    assert run_ranks(_op_worker) == [[], []]


def test_power_of_two_scaling_in_bf16_is_exact():
    """The CUDA kernels scale bf16 rows by a power-of-two block scale with one packed bf16
    multiply (fp8_rows.cuh, scaled_pow2_bf16), not in fp32: the same e4m3 bytes for every finite
    bf16 value and every power-of-two scale that keeps it within +-448 (a block's scale is at
    most 448 / its amax), exhaustively."""
    x = torch.arange(-(2 ** 15), 2 ** 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = x[torch.isfinite(x)]
    for k in range(-126, 128):
        scale = 2.0 ** k
        xs = x[x.float().abs() * scale <= E4M3_MAX]
        in_fp32 = _to_e4m3(xs.float() * scale)
        in_bf16 = _to_e4m3((xs * torch.tensor(scale, dtype=torch.bfloat16)).float())
        assert torch.equal(in_fp32.view(torch.uint8), in_bf16.view(torch.uint8)), k


def test_packed_power_of_two_block_scales_match_the_reference():
    """fp8_rows.cuh's fp8_block_scales2 computes the power-of-two scales of two bf16 block amaxes
    on their 16-bit fields at once (no division): t = (amax + 0x1F) & 0xFF80 per half, scale =
    the bf16 of bits 0x8300 - t, scale_inv = the float of bits (t - 0x400) << 16, for every amax
    in [2^-118, largest finite]. The same scales and reciprocals as block_scales (TE's rule) for
    every such bf16 amax, exhaustively, and packed two to a word without carries between halves."""
    bits = torch.arange(0x480, 0x7F80, dtype=torch.int32)  # 2^-118 .. largest finite bf16
    amax = (bits << 16).view(torch.float32)
    want = block_scales(amax, 0.0, True, torch.bfloat16)
    t = (bits + 0x1F) & 0xFF80
    scale = ((0x8300 - t) << 16).view(torch.float32)
    inv = ((t - 0x400) << 16).view(torch.float32)
    assert torch.equal(scale, want)
    assert torch.equal(inv, torch.reciprocal(want))
    lo, hi = bits, bits.flip(0)  # every amax beside another one, as one 32-bit word
    t2 = ((hi.to(torch.int64) << 16 | lo) + 0x001F001F) & 0xFF80FF80
    scales2 = 0x83008300 - t2
    assert torch.equal(scales2 & 0xFFFF, (0x8300 - t).to(torch.int64))
    assert torch.equal(scales2 >> 16, (0x8300 - t.flip(0)).to(torch.int64))
