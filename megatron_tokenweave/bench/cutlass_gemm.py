"""CUTLASS's sm90 GEMMs (its 3.x API) as a benchmark reference (`bench gemm_fused --cutlass`): the
warp-specialized kernels the communicating GEMM could have been built on, in the tile shapes,
schedules and cluster shapes that matter for its question, whether a cluster whose CTAs share
operand tiles through TMA multicast (what cuBLAS's kernels use at these shapes) beats one CTA
per tile on the row-parallel shards.

Built on first use from csrc/bench/cutlass_gemm.cuh (one translation unit per configuration,
compiled in parallel) into `$TOKENWEAVE_BUILD_DIR/cutlass` (default
`~/.cache/megatron_tokenweave/cutlass`); needs a source checkout (the header is not
installed), an sm_90 GPU, nvcc and the `nvidia-cutlass` package (its C++ headers). bf16 only,
K and N multiples of 8, operands 16-byte aligned.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

_SCHEDULES = {  # kernel schedule: (mainloop, epilogue)
    "coop": ("cutlass::gemm::KernelTmaWarpSpecializedCooperative",
             "cutlass::epilogue::TmaWarpSpecializedCooperative"),
    "pingpong": ("cutlass::gemm::KernelTmaWarpSpecializedPingpong",
                 "cutlass::epilogue::TmaWarpSpecialized"),
}
# name: (schedule, tile M x N (K steps of 64), cluster M x N). Clusters of 2 along M share
# the weight's tiles, along N the activations'.
CONFIGS = {
    f"{schedule}_{m}x{n}_c{cm}x{cn}": (schedule, (m, n), (cm, cn))
    for schedule, (m, n) in (("coop", (128, 256)), ("coop", (256, 128)), ("pingpong", (128, 128)))
    for cm, cn in ((1, 1), (2, 1), (1, 2))
}

_module: ModuleType | None = None


class CutlassUnavailableError(RuntimeError):
    """The CUTLASS reference cannot be built here (no GPU, no nvidia-cutlass headers)."""


def _headers() -> Path:
    try:
        import cutlass_library
    except ImportError as exc:
        raise CutlassUnavailableError(
            "the CUTLASS reference needs the nvidia-cutlass package (its C++ headers): "
            "pip install nvidia-cutlass") from exc
    return Path(cutlass_library.__file__).parent / "source"


HEADER = Path(__file__).resolve().parents[2] / "csrc" / "bench" / "cutlass_gemm.cuh"


def _sources(build: Path) -> list[str]:
    """One translation unit per configuration and the binding, written into `build` (rewritten
    only when their text changes, so a rebuild compiles only what changed)."""
    texts = {}
    for name, (schedule, (m, n), (cm, cn)) in CONFIGS.items():
        mainloop, epilogue = _SCHEDULES[schedule]
        texts[f"{name}.cu"] = (
            f'#include "{HEADER}"\n'
            f"using Tile = cute::Shape<cute::Int<{m}>, cute::Int<{n}>, cute::Int<64>>;\n"
            f"using Cluster = cute::Shape<cute::Int<{cm}>, cute::Int<{cn}>, cute::Int<1>>;\n"
            f"TOKENWEAVE_CUTLASS_GEMM({name}, Tile, Cluster, {mainloop}, {epilogue})\n")
    signature = "const torch::Tensor&, const torch::Tensor&, torch::Tensor&, int64_t"
    texts["bind.cpp"] = (
        "#include <torch/extension.h>\n"
        + "".join(f"void {name}({signature});\n" for name in CONFIGS)
        + "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {\n"
        + "".join(f'  m.def("{name}", &{name});\n' for name in CONFIGS) + "}\n")
    paths = []
    for file, text in texts.items():
        path = build / file
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
        paths.append(str(path))
    return paths


def load(verbose: bool = False) -> ModuleType:
    """The compiled configurations (built on first use; minutes)."""
    global _module
    if _module is not None:
        return _module
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        raise CutlassUnavailableError("the CUTLASS reference is built for sm_90 GPUs")
    if not HEADER.is_file():
        raise CutlassUnavailableError(f"the CUTLASS reference's header {HEADER} is not here "
                                      "(it ships with the source checkout, not the package)")
    from torch.utils.cpp_extension import load as build_extension

    source = _headers()
    default = Path.home() / ".cache" / "megatron_tokenweave"
    build = Path(os.environ.get("TOKENWEAVE_BUILD_DIR", default)) / "cutlass"
    build.mkdir(parents=True, exist_ok=True)
    _module = build_extension(
        name="tokenweave_cutlass_gemm", sources=_sources(build),
        extra_include_paths=[str(source / "include"), str(source / "tools" / "util" / "include")],
        extra_cuda_cflags=["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-DNDEBUG",
                           "-gencode=arch=compute_90a,code=sm_90a"],
        build_directory=str(build), verbose=verbose)
    return _module


def gemm(name: str) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]:
    """out = x @ weight^T on the current stream, by configuration `name` (CONFIGS)."""
    if name not in CONFIGS:
        raise ValueError(f"unknown CUTLASS configuration {name!r}; one of {sorted(CONFIGS)}")
    fn = getattr(load(), name)

    def run(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
        with torch.cuda.device(x.device):
            fn(x, weight, out, torch.cuda.current_stream(x.device).cuda_stream)

    return run
