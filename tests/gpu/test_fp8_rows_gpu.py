"""The fused op writing its normed rows in FP8 (ops.fp8_rows), ranks sharing one GPU (gloo +
CUDA IPC; skips cleanly without a GPU).

Per case the op runs twice on the same inputs: once with normed rows in the activations' dtype,
once with FP8 rows (1 x 128 blocks, with and without power-of-two scales, and one known scale
with its amax). The FP8 rows and their scales must equal, bit for bit, the reference
quantization (Fp8Rows.quantize) of the first call's normed rows, and, where TransformerEngine
imports, TE's own quantizer's output on those rows; residual_out must equal the first call's.
Outputs are poisoned first (NaN bytes, NaN scales), so unwritten rows show. Every replicated data
path: one-shot, pull-all (bulk copies), registers, two-shot (TP 4), the copy engine whole and
phased; bf16 and fp16; odd token counts; a hidden size whose CTA has lanes past the row; blocks
of zeros and of tiny magnitudes (the scales' slow paths); and a CUDA-graph replay on new inputs.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _kernels import kernels_or_skip  # tests/ is on sys.path (conftest.py)

from megatron_tokenweave.launch import NO_MULTICAST_ENV, free_port

os.environ.update(NO_MULTICAST_ENV)

EPS = 1e-5
TOKENS = (1, 7, 129, 1000, 2053)
HIDDENS = (1152, 3584, 4096, 5120)  # 1152: lanes past the row (192 threads, 144 vectors)
SETTINGS = {"default": {}, "pullall": {"oneshot": False, "twoshot": False},
            "registers": {"bulk": False, "oneshot": False, "twoshot": False}}
PATHS = ("default", "pullall", "registers", "copy_engine", "phased")
SCALINGS = ("blocks_pow2", "blocks", "tensor")


def _gen(seed: int, shape, dtype, dev) -> torch.Tensor:
    g = torch.Generator(device=dev)
    g.manual_seed(seed)
    return torch.randn(shape, generator=g, device=dev, dtype=torch.float32).to(dtype)


def _special_blocks(partial: torch.Tensor, residual: torch.Tensor) -> None:
    """Blocks whose scale is not the common case, the same on every rank: row 0's second block
    of 128 columns all zero (scale 1); in bf16 also row 1's third block and row 2's fourth with
    magnitudes in [1, 2] x 2.5e-36 and 1e-37 before the norm (amaxes about 2^-118 and below:
    scales above 2^126, subnormal reciprocals; 448 / amax finite in row 1, overflowing in row 2),
    no element subnormal (the kernels flush those: docs/design.md)."""
    n = residual.shape[0]
    if n < 3:
        return
    partial[0, 0, 128:256] = 0
    residual[0, 128:256] = 0
    if residual.dtype != torch.bfloat16:
        return
    for row, lo, mag in ((1, 256, 2.5e-36), (2, 384, 1e-37)):
        partial[0, row, lo:lo + 128] = 0
        block = residual[row, lo:lo + 128].float()
        residual[row, lo:lo + 128] = block.sign() * (1 + block.abs().clamp(max=1)) * mag


def _fp8_rows(scaling: str, n: int, hidden: int, dev):
    """Poisoned FP8 destinations: NaN bytes, NaN scales (amax starts at 0.25)."""
    from megatron_tokenweave.ops.fp8_rows import FP8_DTYPE, Fp8Rows, scale_stride

    data = torch.full((1, n, hidden), 0x7F, dtype=torch.uint8, device=dev).view(FP8_DTYPE)
    if scaling == "tensor":
        return Fp8Rows.tensor_scaled(
            data, torch.tensor([2.3], device=dev), torch.tensor([0.25], device=dev),
            torch.full((1,), float("nan"), device=dev))
    sinv = torch.full((hidden // 128, scale_stride(n)), float("nan"), device=dev)
    return Fp8Rows.blockwise(data, sinv, amax_eps=0.0, pow2=scaling == "blocks_pow2")


def _reference_of(rows, normed: torch.Tensor):
    """Fp8Rows.quantize of `normed` into fresh tensors like `rows`."""
    from megatron_tokenweave.ops.fp8_rows import Fp8Rows

    ref = Fp8Rows(torch.empty_like(rows.data), rows.scale_inv.clone(),
                  None if rows.blocks else rows.scale.clone(),
                  None if rows.blocks else torch.tensor([0.25], device=normed.device),
                  rows.amax_eps, rows.pow2)
    ref.quantize(normed)
    return ref


def _te_of(rows, normed: torch.Tensor):
    """(data, scale_inv) of TE's quantizer on `normed`, or None without TE."""
    try:
        from transformer_engine.pytorch.tensor.float8_blockwise_tensor import (  # noqa: I001
            Float8BlockQuantizer,
        )
        from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer

        import transformer_engine_torch as tex  # after TE's package, which loads its library
    except ImportError:  # no TE here
        return None
    if rows.blocks:
        q = Float8BlockQuantizer(tex.DType.kFloat8E4M3, rowwise=True, columnwise=False,
                                 amax_epsilon=rows.amax_eps, force_pow_2_scales=rows.pow2,
                                 block_scaling_dim=1)
        out = q(normed)
        return out._rowwise_data, out._rowwise_scale_inv
    q = Float8Quantizer(rows.scale.clone(), torch.zeros(1, device=normed.device),
                        tex.DType.kFloat8E4M3, rowwise=True, columnwise=False)
    out = q(normed)
    return out._data, out._scale_inv


def _same_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    a8, b8 = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    bad = a8 != b8
    if bad.any():
        where = bad.view(-1).nonzero()[:4, 0]
        shown = [(a.reshape(-1)[i].float().item(), b.reshape(-1)[i].float().item())
                 for i in where.tolist()] if a.dtype == b.dtype else []
        raise AssertionError(f"{what}: {bad.sum().item()} of {a8.numel()} bytes differ "
                             f"(first (got, want): {shown})")


def _run(comms, path, args, ctas=4):
    """The op on data path `path` (PATHS; "phased": the copy-engine transfer on a side stream,
    the reduction on the current one, as the woven layer runs it)."""
    if path in ("copy_engine", "phased"):
        comm = comms["default"]
        if path == "copy_engine":
            comm.run(*args, ctas=ctas, path="copy_engine")
            return
        main, side = torch.cuda.current_stream(), _SIDE[0]
        side.wait_stream(main)
        with torch.cuda.stream(side):
            comm.run(*args, ctas=ctas, path="copy_engine", phase="transfer")
        main.wait_stream(side)
        comm.run(*args, ctas=ctas, path="copy_engine", phase="reduce")
        return
    comms[path].run(*args, ctas=ctas)


_SIDE: list[torch.cuda.Stream] = []


def _worker(rank: int, world: int, port: int) -> None:
    from megatron_tokenweave import kernels
    from megatron_tokenweave.ops.validate import Layout

    os.environ.update(NO_MULTICAST_ENV)
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    dev = torch.device("cuda", 0)
    _SIDE.append(torch.cuda.Stream(priority=torch.cuda.Stream.priority_range()[1]))
    buf = kernels.SymmetricBuffer(dist.group.WORLD, 64 << 20, dev, timeout_s=30)
    mirror = kernels.CopyEngineMirror(buf, buf.nbytes)
    comms = {}
    for name, kw in SETTINGS.items():
        comms[name] = kernels.KernelComm(buf, kernels.KernelSettings(**kw))
        comms[name].attach_mirror(mirror)
    layout = Layout.REPLICATED
    seed, te_checked, cases = 900, 0, 0
    for n, hidden, dtype, path in itertools.product(TOKENS, HIDDENS,
                                                     (torch.bfloat16, torch.float16), PATHS):
        seed += 1
        part = buf.view(dtype, (1, n, hidden), 0)
        partial_in = _gen(seed * 8 + rank, (1, n, hidden), dtype, dev)
        residual = _gen(seed * 8 + 7, (n, hidden), dtype, dev)
        weight = (1.0 + 0.1 * _gen(seed * 8 + 6, (hidden,), dtype, dev)).to(dtype)
        _special_blocks(partial_in, residual)
        part.copy_(partial_in)
        res_t = torch.full_like(residual, float("nan"))
        normed_t = torch.full((1, n, hidden), float("nan"), dtype=dtype, device=dev)
        _run(comms, path, (part, residual, weight, EPS, res_t, normed_t, layout))
        for scaling in SCALINGS:
            rows = _fp8_rows(scaling, n, hidden, dev)
            part.copy_(partial_in)  # the two-shot path writes y back into the partial
            res = torch.full_like(residual, float("nan"))
            _run(comms, path, (part, residual, weight, EPS, res, rows, layout))
            torch.cuda.synchronize()
            what = f"TP{world} rank {rank} n={n} H={hidden} {dtype} {path} {scaling}"
            assert not torch.isnan(normed_t).any(), what
            _same_bits(res, res_t, f"{what}: residual_out")
            te = _te_of(rows, normed_t[0])
            if te is not None:
                _same_bits(rows.data[0], te[0].view(rows.data.dtype),
                           f"{what}: FP8 rows against TE's quantizer")
                sinv = rows.scale_inv[:, :n] if rows.blocks else rows.scale_inv
                te_sinv = te[1][:, :n] if rows.blocks else te[1]
                _same_bits(sinv, te_sinv, f"{what}: scale_inv against TE's quantizer")
                te_checked += 1
            ref = _reference_of(rows, normed_t[0])
            if rows.blocks and n >= 3:  # the special blocks are what they are meant to be
                assert ref.scale_inv[1, 0].item() == 1.0, f"{what}: zero block"
                if dtype == torch.bfloat16:
                    assert ref.scale_inv[2:4, 1:3].diagonal().max().item() < 2.0 ** -120, what
            _same_bits(rows.data, ref.data, f"{what}: FP8 rows")
            if rows.blocks:
                _same_bits(rows.scale_inv[:, :n], ref.scale_inv[:, :n], f"{what}: scale_inv")
            else:
                _same_bits(rows.scale_inv, ref.scale_inv, f"{what}: scale_inv")
                _same_bits(rows.amax, ref.amax, f"{what}: amax")
                assert rows.amax.item() >= 0.25
            cases += 1
    _graph_replay(comms["default"], buf, dev, layout)
    buf.check_error()
    for c in comms.values():
        c.close()
    buf.close()
    if rank == 0:
        print(f"[TP{world}] FP8 rows: {cases} cases bit-exact, {te_checked} also against TE's "
              "quantizers", flush=True)
    dist.destroy_process_group()


def _graph_replay(comm, buf, dev, layout) -> None:
    """A captured FP8 call replayed on new inputs equals an eager call on them."""
    n, hidden, dtype = 333, 4096, torch.bfloat16
    part = buf.view(dtype, (1, n, hidden), 0)
    residual = torch.empty(n, hidden, dtype=dtype, device=dev)
    weight = (1.0 + 0.1 * _gen(5, (hidden,), dtype, dev)).to(dtype)
    res = torch.empty_like(residual)
    rows = _fp8_rows("blocks_pow2", n, hidden, dev)
    args = (part, residual, weight, EPS, res, rows, layout)
    rank = dist.get_rank()
    part.copy_(_gen(1 + rank, (1, n, hidden), dtype, dev))
    residual.copy_(_gen(3, (n, hidden), dtype, dev))
    comm.run(*args, ctas=8)  # warm up
    torch.cuda.synchronize()
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        comm.run(*args, ctas=8, validate=False)
    for k in range(3):
        part.copy_(_gen(100 + 10 * k + rank, (1, n, hidden), dtype, dev))
        residual.copy_(_gen(200 + k, (n, hidden), dtype, dev))
        want_in = part.clone()
        rows.data.view(torch.uint8).fill_(0x7F)
        torch.cuda.synchronize()
        dist.barrier()
        graph.replay()
        torch.cuda.synchronize()
        got = (rows.data.clone(), rows.scale_inv.clone())
        part.copy_(want_in)
        normed = torch.empty(1, n, hidden, dtype=dtype, device=dev)
        torch.cuda.synchronize()
        dist.barrier()
        comm.run(part, residual, weight, EPS, torch.empty_like(res), normed, layout, ctas=8)
        torch.cuda.synchronize()
        ref = _reference_of(rows, normed[0])
        _same_bits(got[0], ref.data, f"graph replay {k}: FP8 rows")
        _same_bits(got[1][:, :n], ref.scale_inv[:, :n], f"graph replay {k}: scale_inv")


@pytest.mark.parametrize("world", [2, 4])
def test_fp8_rows_bit_exact_ranks_sharing_one_gpu(world):
    """TP 2 and 4 as processes sharing GPU 0 (functional, never a performance figure)."""
    kernels_or_skip()
    mp.spawn(_worker, args=(world, free_port()), nprocs=world, join=True)
