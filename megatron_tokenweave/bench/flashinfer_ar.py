"""FlashInfer's TRT-LLM fused all-reduce + residual add + RMSNorm, as a kernel-benchmark peer.

`flashinfer_fused` wraps `flashinfer.comm.trtllm_allreduce_fusion` (flashinfer-python 0.7.4,
pattern `AllReduceFusionPattern.kARResidualRMSNorm`) in the replicated layout of our op: each
rank passes its un-reduced partial sums x [T, hidden] and the residual [T, hidden]; every rank
gets the whole new residual (x summed over ranks + residual) and its RMSNorm rows.

No NVLink multicast. The only workspace path used is
`trtllm_create_ipc_workspace_for_all_reduce_fusion(..., create_metadata=True,
use_symm_dev_mem=False)`; the MNNVL paths (`trtllm_mnnvl_*`, `mnnvl_cutedsl_*`, the unified
`allreduce_fusion` with `backend="auto"`), NVSHMEM and `SymmDeviceMemory` are never called. What
was checked, reading the sources (flashinfer 0.7.4 wheel; PyTorch's c10d symm_mem sources):
- flashinfer/comm/trtllm_ar.py, that function with use_symm_dev_mem=False: builds no CommBackend
  and no `SymmDeviceMemory`; its three buffers come from
  flashinfer/comm/torch_symmetric_memory.py `_alloc_symm_buffer_bytes`, which is
  `torch.distributed._symmetric_memory.empty` + `rendezvous` + `get_buffer(peer).data_ptr()`
  (on torch >= 2.11 `_enable_symm_mem_for_group` returns at once). The rest is ctypes cudart
  (`cudaMalloc` of a 20-byte flag word, `cudaMemset`, `cudaMemcpy`; comm/cuda_ipc.py), the JIT'd
  `trtllm_lamport_initialize` kernel, `torch.tensor` and `dist.barrier`.
- Python-level `cuMulticastCreate` exists only in comm/mnnvl.py (`SymmDeviceMemory` with
  enable_multicast) and comm/mixed_comm.py; neither is reached (trtllm_ar.py imports mnnvl.py
  only for names). Importing flashinfer / flashinfer.comm sets no NCCL/NVSHMEM/TORCH_SYMM*
  variable and calls no `symm_mem.set_backend` at import time.
- The JIT'd kernels (data/csrc/trtllm_allreduce*.cu, include/flashinfer/comm/
  trtllm_allreduce_fusion.cuh) use plain peer loads/stores on the IPC pointers: no multimem
  instructions, no multicast object.
- PyTorch symm_mem (c10d/symm_mem sources of a 2026 main commit, not the 2.11 tag, hence the
  runtime check below): the CUDA allocator (CUDASymmetricMemory.cu) maps peers through POSIX-fd
  (or fabric) handles and calls `init_multicast_for_block` (its only `cuMulticastCreate`) only
  when every rank's `device_has_multicast_support()` is true; that function
  (CUDASymmetricMemoryUtils.cpp) returns false when TORCH_SYMM_MEM_DISABLE_MULTICAST=1. The CUDA
  allocator is the default unless TORCH_SYMMMEM names NVSHMEM or NCCL.
So before anything is allocated this module requires NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1, TORCH_SYMMMEM unset or "CUDA", the
symm-mem backend reported as "CUDA", and `_SymmetricMemory.has_multicast_support(CUDA, dev)`
(which asks the installed torch's `device_has_multicast_support`, the check rendezvous uses) to
be false; otherwise it returns a reason and allocates nothing.

Runtime notes: flashinfer JIT-compiles its comm kernels with nvcc on first use (4-7 minutes for
sm_90a; cached under $FLASHINFER_WORKSPACE_BASE or ~/.cache/flashinfer) unless a prebuilt module
is staged (`.ci/stage_flashinfer.sh --aot`; `flashinfer_fused` installs it through
`_install_prebuilt`). FLASHINFER_JIT_VERBOSE=1
(without FLASHINFER_JIT_DEBUG=0) builds -O0 -G kernels, so it is refused here.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megatron_tokenweave.launch import NO_MULTICAST_ENV

_REASON_CHARS = 300


def _reason(what: str, exc: BaseException | None = None) -> str:
    text = what if exc is None else f"{what}: {type(exc).__name__}: {exc}"
    return " ".join(text.split())[:_REASON_CHARS]


def _env_refusal() -> str | None:
    """Why the multicast kill-switch environment is not in place, or None."""
    off = [f"{k}={v}" for k, v in NO_MULTICAST_ENV.items() if os.environ.get(k) != v]
    if off:
        return _reason("refused: the multicast kill-switches must be set: " + ", ".join(off))
    backend = os.environ.get("TORCH_SYMMMEM")
    if backend not in (None, "CUDA"):
        return _reason(f"refused: TORCH_SYMMMEM={backend!r}; only the CUDA symm-mem backend")
    return None


def _symm_mem_refusal(device: torch.device) -> str | None:
    """Why torch symmetric memory could still set up multicast on `device`, or None."""
    try:
        from torch._C._autograd import DeviceType
        from torch._C._distributed_c10d import _SymmetricMemory

        get_backend = getattr(_SymmetricMemory, "get_backend", None)
        name = get_backend(device) if get_backend is not None else "CUDA"
        if name not in (None, "CUDA"):
            return _reason(f"refused: torch symmetric memory backend is {name!r}, not 'CUDA'")
        if _SymmetricMemory.has_multicast_support(DeviceType.CUDA, device.index):
            return _reason("refused: torch symmetric memory still reports multicast support")
    except Exception as exc:  # any failure here means: do not go on
        return _reason("refused: cannot check torch symmetric memory for multicast", exc)
    return None


def _jit_refusal() -> str | None:
    debug = os.environ.get("FLASHINFER_JIT_DEBUG")
    if (debug if debug is not None else os.environ.get("FLASHINFER_JIT_VERBOSE", "0")) == "1":
        return "refused: FLASHINFER_JIT_DEBUG/VERBOSE=1 would build -O0 -G kernels"
    return None


def _default_cuda_home() -> None:
    """Point flashinfer's JIT at a CUDA toolkit holding headers when no CUDA_HOME is given.

    flashinfer takes CUDA_HOME, else CUDA_PATH, else the grandparent of `which nvcc`; a wrapper
    script such as /usr/local/bin/nvcc would give /usr/local, without cuda_runtime.h or lib64.
    """
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    nvcc = shutil.which("nvcc")
    candidates = [os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))] if nvcc else []
    candidates.append("/usr/local/cuda")
    for home in candidates:
        if os.path.exists(os.path.join(home, "include", "cuda_runtime.h")) and os.path.exists(
            os.path.join(home, "bin", "nvcc")
        ):
            os.environ["CUDA_HOME"] = home
            return


def _install_prebuilt(device: torch.device) -> str:
    """Put a staged trtllm_comm.so (sm_90a) where flashinfer loads prebuilt (AOT) modules.

    From TOKENWEAVE_FLASHINFER_SO, else .dw/flashinfer/aot/trtllm_comm.so of this checkout or of
    the working directory (`.ci/stage_flashinfer.sh --aot` builds it). Returns how the module will
    be had. flashinfer falls back to its JIT build if the file does not load.
    """
    from flashinfer.jit import env as jit_env

    dst = jit_env.FLASHINFER_AOT_DIR / "trtllm_comm" / "trtllm_comm.so"
    if dst.exists():
        return "prebuilt module"
    rel = os.path.join(".dw", "flashinfer", "aot", "trtllm_comm.so")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sources = [os.environ.get("TOKENWEAVE_FLASHINFER_SO", ""), os.path.join(repo, rel), rel]
    src = next((f for f in sources if f and os.path.isfile(f)), None)
    if src is None or torch.cuda.get_device_capability(device) != (9, 0):
        return "JIT-built module"
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f"{dst.name}.{os.getpid()}")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)  # atomic: the other ranks may do the same
    return "prebuilt module (staged)"


def _load(device: torch.device) -> tuple[Any, str | None, str]:
    """Import flashinfer's trtllm_ar and load its comm kernels: (module, refusal, how)."""
    refusal = _jit_refusal()
    if refusal:
        return None, refusal, ""
    _default_cuda_home()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from flashinfer.comm import trtllm_ar
    except Exception as exc:  # missing or broken flashinfer
        return None, _reason("flashinfer not importable", exc), ""
    try:
        how = _install_prebuilt(device)
        trtllm_ar.get_trtllm_comm_module()
    except Exception as exc:  # nvcc, headers, ninja, tvm-ffi load
        return None, _reason("flashinfer trtllm_comm module failed to build/load", exc), ""
    return trtllm_ar, None, how


def _all_ok(ok: bool, group: Any, device: torch.device) -> bool:
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


class FlashInferFused:
    """Callable around one flashinfer all-reduce-fusion workspace (see `flashinfer_fused`)."""

    def __init__(
        self,
        fi: Any,
        group: Any,
        device: torch.device,
        hidden: int,
        created: tuple[list[list[int]], torch.Tensor, dict],
        launch_with_pdl: bool,
        fp32_acc: bool,
    ) -> None:
        self._fi = fi
        self._group = group
        self._device = device
        self._hidden = hidden
        self._handles, self._workspace, self._metadata = created
        self._flag_ptr = int(self._workspace[-1].item())  # cudaMalloc'd by flashinfer
        self._rank = dist.get_rank(group)
        self._world = dist.get_world_size(group)
        self._pdl = launch_with_pdl
        self._fp32_acc = fp32_acc
        self._pattern = fi.AllReduceFusionPattern.kARResidualRMSNorm
        op = fi.trtllm_allreduce_fusion
        self._op = getattr(op, "__wrapped__", op)  # skip @deprecated's per-call warning
        self._closed = False

    @property
    def workspace_bytes(self) -> int:
        """Bytes of symmetric memory this rank holds for the workspace."""
        m = self._metadata
        return int(m["buffer_size"] + m["flag_size"] + m["lamport_buffer_size"])

    def __call__(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual_out: torch.Tensor,
        norm_out: torch.Tensor,
        oneshot: bool | None = None,
    ) -> None:
        """residual_out = sum over ranks of x + residual; norm_out = RMSNorm(residual_out) * weight.

        oneshot None: flashinfer's heuristic (one-shot Lamport vs two-shot); two-shot needs more
        tokens than ranks.
        """
        if self._closed:
            raise RuntimeError("flashinfer workspace already closed")
        if x.dim() != 2 or x.shape[1] != self._hidden or not x.is_contiguous():
            raise ValueError(f"x must be a contiguous [T, {self._hidden}] tensor")
        self._op(
            allreduce_in=x,
            world_size=self._world,
            world_rank=self._rank,
            token_num=x.shape[0],
            hidden_dim=self._hidden,
            workspace_ptrs=self._workspace,
            launch_with_pdl=self._pdl,
            trigger_completion_at_end=True,
            fp32_acc=self._fp32_acc,
            pattern_code=self._pattern,
            use_oneshot=oneshot,
            allreduce_out=None,
            residual_in=residual,
            residual_out=residual_out,
            norm_out=norm_out,
            quant_out=None,
            scale_out=None,
            rms_gamma=weight,
            rms_eps=float(eps),
            scale_factor=None,
            layout_code=None,
            metadata=self._metadata,
        )

    def close(self) -> None:
        """Collective: drop the symmetric buffers and free the flag word (idempotent)."""
        if self._closed:
            return
        self._closed = True
        torch.cuda.synchronize(self._device)
        dist.barrier(group=self._group)  # no peer still reads or writes our buffers
        self._fi.trtllm_destroy_ipc_workspace_for_all_reduce_fusion(self._handles, self._group)
        if self._flag_ptr:
            self._fi.cudart.cudaFree(ctypes.c_void_p(self._flag_ptr))
        self._workspace = None


def flashinfer_fused(
    group: Any,
    max_tokens: int,
    hidden: int,
    dtype: torch.dtype,
    device: torch.device,
    *,
    launch_with_pdl: bool = False,
    fp32_acc: bool = True,
) -> tuple[Callable | None, str]:
    """Set up FlashInfer's fused all-reduce + residual + RMSNorm on `group`.

    Collective over `group` (one process per GPU, every rank calls it). Returns (fn, description)
    with fn a `FlashInferFused`, called as fn(x, residual, weight, eps, residual_out, norm_out,
    oneshot=None), fn.close() freeing the workspace; or (None, reason) when it cannot run here:
    multicast guards not met, flashinfer missing, JIT failure, unsupported shape. Never raises for
    those. A missing kill-switch variable returns at once, before any collective (all ranks share
    one environment); past that, the ranks agree before the workspace's collective allocations.
    A failure inside those allocations on one rank only (e.g. out of memory) leaves the others
    waiting in FlashInfer's collectives: a benchmark-only helper, not a product path.
    """
    device = torch.device(device)
    reason = _env_refusal()
    if reason is not None:
        return None, reason
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    reason = _symm_mem_refusal(device)
    if reason is None and world not in (2, 4, 8, 16):
        reason = f"unsupported: world size {world} (flashinfer supports 2, 4, 8, 16)"
    if reason is None and dtype not in (torch.bfloat16, torch.float16, torch.float32):
        reason = f"unsupported: dtype {dtype}"
    if reason is None and hidden % (16 // itemsize):
        reason = f"unsupported: hidden {hidden} is not a multiple of one 16-byte vector"
    fi, how = None, ""
    if reason is None:
        with torch.cuda.device(device):
            fi, reason, how = _load(device)
    # Agree before the collective allocations, so no rank enters a rendezvous alone.
    if not _all_ok(reason is None, group, device):
        return None, reason or "another rank could not set up flashinfer"
    try:
        with torch.cuda.device(device), warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            created = fi.trtllm_create_ipc_workspace_for_all_reduce_fusion(
                tp_rank=rank,
                tp_size=world,
                max_token_num=max_tokens,
                hidden_dim=hidden,
                use_fp32_lamport=dtype == torch.float32,
                group=group,
                create_metadata=True,
                use_symm_dev_mem=False,
            )
        fn = FlashInferFused(fi, group, device, hidden, created, launch_with_pdl, fp32_acc)
    except Exception as exc:  # report, don't crash the benchmark
        return None, _reason("flashinfer workspace creation failed", exc)
    version = getattr(sys.modules.get("flashinfer"), "__version__", "?")
    limit_mb = getattr(fi, "_use_oneshot_heuristics", {}).get(world)
    auto = "flashinfer's heuristic"
    if limit_mb:  # one-shot while T * hidden * 2 * world * itemsize <= limit MiB
        auto += f" (one-shot up to {(limit_mb << 20) // (hidden * 2 * world * itemsize)} tokens)"
    return fn, _reason(
        f"flashinfer {version} trtllm_allreduce_fusion kARResidualRMSNorm, TP={world}, "
        f"max {max_tokens} tokens x {hidden}, {str(dtype).removeprefix('torch.')}, "
        f"fp32_acc={fp32_acc}, pdl={launch_with_pdl}, oneshot=None: {auto}; {how}; workspace "
        f"{fn.workspace_bytes >> 20} MiB/rank, torch symmetric memory (CUDA backend, no multicast)"
    )
