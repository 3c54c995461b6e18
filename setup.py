"""megatron-tokenweave: pure-Python everywhere; the CUDA extension `megatron_tokenweave._C` is built
when a CUDA build of torch and nvcc are present (install with --no-build-isolation so the build
sees your torch). TOKENWEAVE_NO_CUDA_EXT=1 skips it; TOKENWEAVE_CUDA_ARCHS picks the targets
(default "90"; "80;90" adds A100)."""

from __future__ import annotations

import glob
import os
import sys

from setuptools import find_packages, setup


def cuda_extension() -> tuple[list, dict]:
    """The CUDA extension where it can be built; otherwise say why on stderr (pure Python)."""
    if os.environ.get("TOKENWEAVE_NO_CUDA_EXT") == "1":
        return _skip("TOKENWEAVE_NO_CUDA_EXT=1")
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError as exc:
        return _skip(f"torch is not importable in the build environment ({exc}); "
                     "use pip install --no-build-isolation")
    if torch.version.cuda is None or CUDA_HOME is None:
        return _skip(f"torch {torch.__version__} has no CUDA or no CUDA toolkit was found")
    here = os.path.dirname(os.path.abspath(__file__))
    sources = sorted(glob.glob(os.path.join(here, "csrc", "*.cu")))
    sources += sorted(glob.glob(os.path.join(here, "csrc", "*.cpp")))
    if not sources:
        return _skip(f"no sources under {os.path.join(here, 'csrc')}")
    archs = os.environ.get("TOKENWEAVE_CUDA_ARCHS", "90").replace(",", ";").split(";")
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs if a]
    ext = CUDAExtension(
        name="megatron_tokenweave._C",
        sources=[os.path.relpath(p, here) for p in sources],
        include_dirs=[os.path.join(here, "csrc", "include")],
        extra_compile_args={
            "cxx": ["-O3", "-std=c++17"],
            "nvcc": ["-O3", "-std=c++17", "--use_fast_math", *gencode],
        },
    )
    print(f"megatron-tokenweave: building the CUDA extension for sm_{archs}", file=sys.stderr)
    return [ext], {"build_ext": BuildExtension}


def _skip(reason: str) -> tuple[list, dict]:
    print(f"megatron-tokenweave: no CUDA extension ({reason})", file=sys.stderr)
    return [], {}


ext_modules, cmdclass = cuda_extension()

setup(
    name="megatron-tokenweave",
    version="0.1.0",
    description="TokenWeave compute-communication overlap for Megatron-Core TP inference",
    long_description=open("README.md").read() if os.path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_tokenweave", "megatron_tokenweave.*"]),
    package_data={"megatron_tokenweave": ["tables/*.json"]},
    install_requires=["torch>=2.6", "megatron-core>=0.16", "numpy", "packaging"],
    extras_require={"te": ["transformer-engine[pytorch]>=2.0"], "test": ["pytest"],
                    "bench": ["matplotlib"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
