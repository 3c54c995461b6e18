"""megatron-tokenweave: pure-Python everywhere; the CUDA extension `megatron_tokenweave._C` is built
when a CUDA build of torch and nvcc are present (install with --no-build-isolation so the build
sees your torch). TOKENWEAVE_NO_CUDA_EXT=1 skips it; TOKENWEAVE_CUDA_ARCHS picks the targets
(default "90"; "80;90" adds A100). The compiler flags live in megatron_tokenweave/build_flags.py."""

from __future__ import annotations

import glob
import importlib.util
import os
import sys

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def load_build_flags():
    """megatron_tokenweave/build_flags.py, loaded by path: neither the package nor torch is
    imported (the build may run before they are importable)."""
    path = os.path.join(HERE, "megatron_tokenweave", "build_flags.py")
    spec = importlib.util.spec_from_file_location("_tokenweave_build_flags", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def extra_compile_args() -> dict[str, list[str]]:
    """The extension's flags (archs: TOKENWEAVE_CUDA_ARCHS); exits saying why if that is invalid."""
    flags = load_build_flags()
    try:
        return {"cxx": flags.cxx_flags(), "nvcc": flags.nvcc_flags()}
    except flags.ArchListError as exc:
        sys.exit(f"megatron-tokenweave: {exc}")


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
    sources = sorted(glob.glob(os.path.join(HERE, "csrc", "*.cu")))
    sources += sorted(glob.glob(os.path.join(HERE, "csrc", "*.cpp")))
    if not sources:
        return _skip(f"no sources under {os.path.join(HERE, 'csrc')}")
    args = extra_compile_args()
    ext = CUDAExtension(
        name="megatron_tokenweave._C",
        sources=[os.path.relpath(p, HERE) for p in sources],
        include_dirs=[os.path.join(HERE, "csrc", "include")],
        extra_compile_args=args,
    )
    archs = ", ".join(f.rsplit("=", 1)[1] for f in args["nvcc"] if f.startswith("-gencode="))
    print(f"megatron-tokenweave: building the CUDA extension for {archs}", file=sys.stderr)
    return [ext], {"build_ext": BuildExtension}


def _skip(reason: str) -> tuple[list, dict]:
    print(f"megatron-tokenweave: no CUDA extension ({reason})", file=sys.stderr)
    return [], {}


def main() -> None:
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


if __name__ == "__main__":  # how pip / setuptools run it; tests load it to read its flags
    main()
