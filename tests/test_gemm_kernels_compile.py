"""The GEMM-fused mechanism's two GEMM kernels compile for Hopper (sm_90) with the installed
Triton, without a GPU: every tile shape of ops/segments.py, bf16 and fp16, with and without bias,
and their FP8 forms (e4m3 operands: the one-consumer kernel per-tensor and block scales, the
ping-pong kernel per-tensor).
Gluon's API still moves between Triton versions (a TMA load was renamed after 3.6); this catches
it before a GPU does. The PTX has the MMAs, 16-byte output stores and one system-scope fence per
CTA (the flags' release), the properties docs/kernel.md relies on; in the one-consumer kernel
(plain Triton, whose layouts the compiler picks) the flag lanes are laid out one per lane of
every warp, so warp 0, which alone stores flags, holds all of them."""

from __future__ import annotations

import importlib.util
import itertools
import re
from typing import Any

import pytest
import torch
from _dist import run_ranks

triton = pytest.importorskip("triton")
if importlib.util.find_spec("triton.experimental.gluon") is None:
    pytest.skip("Triton without Gluon", allow_module_level=True)

from megatron_tokenweave.ops.segments import LARGE, PINGPONG, SMALL, WIDE  # noqa: E402

# Arguments the launcher's specialization marks 16-divisible (not in owner_protocol.PER_CALL).
ALIGNED = ("N", "K", "slots_off", "control_ptr", "bias_ptr") + tuple(f"r{i}" for i in range(8))
TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def _signature(fn: Any, descriptors: dict, dtype: torch.dtype, consts: dict) -> tuple:
    """The launcher's specialization of a kernel: types, constexprs, 16-divisible arguments."""
    sig = {name: "i32" for name in fn.arg_names}
    scales = {n: "*fp32" for n in ("xs_ptr", "ws_ptr") if n in fn.arg_names}
    sig.update(descriptors, bias_ptr="*" + TYPES[dtype], control_ptr="*i32", **scales,
               **{f"r{i}": "i64" for i in range(8)}, **dict.fromkeys(consts, "constexpr"))
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in ALIGNED}
    return sig, attrs


def _compile(source: Any, warps: int, stages: int | None = None) -> dict[str, Any]:
    """The kernel's assembly by stage (ptx, ttgir, ...)."""
    from triton.backends.compiler import GPUTarget

    options = {"num_warps": warps} | ({"num_stages": stages} if stages else {})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm


def _range_layout(ttgir: str, n: int) -> str:
    """The layout definition of the kernel's arange(0, n) (the flag lanes for n = 32)."""
    ranges = re.findall(rf"tt\.make_range {{end = {n} : i32, start = 0 : i32}} : "
                        rf"tensor<{n}xi32, (#[\w]+)>", ttgir)
    assert len(set(ranges)) == 1, f"arange(0, {n}) layouts: {ranges}"
    definition = re.search(rf"^{re.escape(ranges[0])} = (.*)$", ttgir, re.M)
    assert definition, ranges[0]
    return definition.group(1)


def _one_consumer_asm(tiles: Any, bias: bool, dtype: torch.dtype,
                      scales: int = 0) -> dict[str, Any]:
    """scales: 16-bit operands (0), or e4m3 ones scaled per tensor (1) or in blocks (2), the
    rows in `dtype`, K blocks of FP8_BLOCK_K."""
    from dataclasses import replace

    from triton.compiler import ASTSource

    from megatron_tokenweave.kernels.owner_gemm import _owner_gemm_kernel as fn
    from megatron_tokenweave.ops.segments import FP8_BLOCK_K

    if scales:
        tiles = replace(tiles, block_k=FP8_BLOCK_K)
    consts = dict(HAS_BIAS=bias, OUT_BF16=dtype == torch.bfloat16, SCALES=scales,
                  BM=tiles.block_rows, BN=tiles.block_cols, BK=tiles.block_k,
                  GROUP_M=tiles.group_rows, HALVES=tiles.block_cols >= 256, FLAG_LANES=32,
                  RELEASE=True)
    t = "fp8e4nv" if scales else TYPES[dtype]
    sig, attrs = _signature(fn, {
        "a_desc": f"tensordesc<{t}[{tiles.block_rows}, {tiles.block_k}]>",
        "b_desc": f"tensordesc<{t}[{tiles.block_cols}, {tiles.block_k}]>"}, dtype, consts)
    return _compile(ASTSource(fn, sig, consts, attrs), tiles.warps, tiles.stages)


def _pingpong_asm(bias: bool, dtype: torch.dtype, scaled: bool = False) -> dict[str, Any]:
    """scaled: e4m3 operands scaled per tensor, the rows in `dtype`, K blocks of FP8_BLOCK_K."""
    from dataclasses import replace

    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    from megatron_tokenweave.kernels.owner_gemm_pingpong import _pingpong_kernel as fn
    from megatron_tokenweave.kernels.owner_gemm_pingpong import _smem_layout
    from megatron_tokenweave.ops.segments import FP8_BLOCK_K

    t = replace(PINGPONG, block_k=FP8_BLOCK_K) if scaled else PINGPONG
    host = torch.empty(256, 256, dtype=torch.float8_e4m3fn if scaled else dtype)

    def desc(rows: int) -> str:
        layout = _smem_layout(rows, t.block_k, host.dtype)
        return mangle_type(TensorDescriptor.from_tensor(host, [rows, t.block_k], layout))

    consts = dict(HAS_BIAS=bias, OUT_BF16=dtype == torch.bfloat16, SCALED=scaled,
                  GROUP_M=t.group_rows, STAGES=t.stages, RELEASE=True)
    sig, attrs = _signature(fn, {"a_desc": desc(t.block_rows), "b_desc": desc(t.block_cols)},
                            dtype, consts)
    return _compile(GluonASTSource(fn, sig, consts, attrs), t.warps)


TILES = {"large": LARGE, "wide": WIDE, "small": SMALL}


def _compile_all(rank: int, world: int) -> dict[tuple, dict[str, str]]:
    """Every variant's PTX and TTGIR, compiled in a rank of its own: Triton's Gluon bindings
    then live and die in that process (which exits without the interpreter's teardown, where
    nanobind reports the objects Triton keeps for the process's life)."""
    out = {}
    for dtype, bias in itertools.product(TYPES, (False, True)):
        for name, tiles in TILES.items():
            asm = _one_consumer_asm(tiles, bias, dtype)
            out[("one", name, bias, dtype)] = {k: asm[k] for k in ("ptx", "ttgir")}
            for scales in (1, 2):
                out[("fp8", name, bias, dtype, scales)] = {
                    "ptx": _one_consumer_asm(tiles, bias, dtype, scales)["ptx"]}
        for scaled in (False, True):
            out[("pingpong", bias, dtype, scaled)] = {
                "ptx": _pingpong_asm(bias, dtype, scaled)["ptx"]}
    return out


@pytest.fixture(scope="module")
def assembly() -> dict[tuple, dict[str, str]]:
    return run_ranks(_compile_all, world=1)[0]


@pytest.mark.parametrize("dtype", list(TYPES))
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tiles", list(TILES))
def test_one_consumer_kernel_compiles_for_sm90(assembly, tiles, bias, dtype):
    asm = assembly[("one", tiles, bias, dtype)]
    ptx = asm["ptx"]
    assert "wgmma.mma_async" in ptx
    assert "st.global.v4" in ptx
    assert ptx.count("fence.acq_rel.sys") == 1
    lanes = _range_layout(asm["ttgir"], 32)
    assert "sizePerThread = [1]," in lanes and "threadsPerWarp = [32]," in lanes, lanes


@pytest.mark.parametrize("scales", [1, 2], ids=["tensor_scales", "block_scales"])
@pytest.mark.parametrize("dtype", list(TYPES))
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tiles", list(TILES))
def test_fp8_one_consumer_kernel_compiles_for_sm90(assembly, tiles, bias, dtype, scales):
    """e4m3 operands: FP8 MMAs (e4m3 x e4m3, fp32 accumulator), the same stores and release."""
    ptx = assembly[("fp8", tiles, bias, dtype, scales)]["ptx"]
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.e4m3\.e4m3", ptx)
    assert "st.global.v4" in ptx
    assert ptx.count("fence.acq_rel.sys") == 1


@pytest.mark.parametrize("dtype", list(TYPES))
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("scaled", [False, True], ids=["16bit", "fp8_tensor_scales"])
def test_pingpong_kernel_compiles_for_sm90(assembly, bias, dtype, scaled):
    """16-bit operands, or e4m3 ones scaled per tensor (FP8 MMAs) with rows in `dtype`."""
    ptx = assembly[("pingpong", bias, dtype, scaled)]["ptx"]
    ptx_type = {torch.bfloat16: "bf16", torch.float16: "f16"}[dtype]
    mma = r"k32\.f32\.e4m3\.e4m3" if scaled else rf"k16\.f32\.{ptx_type}\.{ptx_type}"
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+" + mma, ptx)
    assert "setmaxnreg" in ptx  # the partitions really are warp-specialized
    assert "st.global.v4" in ptx
    assert ptx.count("fence.acq_rel.sys") == 1
