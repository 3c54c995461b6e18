"""megatron-tokenweave: pure-Python everywhere; the CUDA extension `megatron_tokenweave._C` is built
when a CUDA build of torch and nvcc are present (install with --no-build-isolation so the build
sees your torch). TOKENWEAVE_NO_CUDA_EXT=1 skips it; TOKENWEAVE_CUDA_ARCHS picks the targets
(default "90"; "80;90" adds A100)."""

from __future__ import annotations

import glob
import os

from setuptools import find_packages, setup


def cuda_extension() -> tuple[list, dict]:
    if os.environ.get("TOKENWEAVE_NO_CUDA_EXT") == "1":
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError:
        return [], {}
    if torch.version.cuda is None or CUDA_HOME is None:
        return [], {}
    sources = sorted(glob.glob("csrc/*.cu") + glob.glob("csrc/*.cpp"))
    if not sources:
        return [], {}
    archs = os.environ.get("TOKENWEAVE_CUDA_ARCHS", "90").replace(",", ";").split(";")
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs if a]
    ext = CUDAExtension(
        name="megatron_tokenweave._C",
        sources=sources,
        include_dirs=[os.path.abspath("csrc/include")],
        extra_compile_args={
            "cxx": ["-O3", "-std=c++17"],
            "nvcc": ["-O3", "-std=c++17", "--use_fast_math", *gencode],
        },
    )
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = cuda_extension()

setup(
    name="megatron-tokenweave",
    version="0.1.0",
    description="TokenWeave compute-communication overlap for Megatron-Core TP inference",
    long_description=open("README.md").read() if os.path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_tokenweave", "megatron_tokenweave.*"]),
    install_requires=["torch>=2.6", "megatron-core>=0.16", "numpy", "packaging"],
    extras_require={"te": ["transformer-engine[pytorch]>=2.0"], "test": ["pytest"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
