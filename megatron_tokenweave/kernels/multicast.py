"""The multimem backend's buffer: a PeerBuffer over torch symmetric memory with a multicast address.

UNTESTED ON HARDWARE HERE. This project's machines forbid NVLink multicast (they set
NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1, which refuse it),
so this module is exercised only by CPU tests of its refusals. It exists for machines where
multicast is allowed (HGX boxes with NVSwitch), where the fused op's SM path can then run the
multimem kernel (csrc/include/tokenweave/multimem.cuh) on a few SMs.

Reachable only with a double opt-in: TokenWeaveConfig.backend="multimem" (constructing a
MulticastBuffer is that request) AND TOKENWEAVE_ALLOW_MULTIMEM=1 in the environment, with no kill
switch set, torch reporting multicast support for the device, the TP group on one node and sm_90
or newer (policy.multimem_backend_refusal). Every rank evaluates the refusal and the ranks agree
(`agreed_refusal`) before the extension is loaded or anything allocated, so either every rank
builds the buffer or every rank raises the same error. torch symmetric memory is imported only
past that point (and by `probe`, which queries the device and allocates nothing).

Layout: each rank's allocation (`symm_mem.empty`, then `symm_mem.rendezvous` on the group) is the
same [header | data] as SymmetricBuffer's; `bases` come from the handle's `buffer_ptrs`, and
`multicast_base` is the handle's `multicast_ptr` + the header bytes (the multicast address of the
data regions, which the multimem kernel reduces from and stores to).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

import torch
import torch.distributed as dist

from megatron_tokenweave.kernels.policy import (
    MULTIMEM,
    MulticastFacts,
    Refusal,
    multimem_backend_refusal,
)
from megatron_tokenweave.kernels.symmetric import PeerBuffer
from megatron_tokenweave.ops.validate import TokenWeaveInputError


def _symm_mem_api():
    """(torch.distributed._symmetric_memory, _SymmetricMemory, DeviceType): imported lazily, so
    that importing this module touches no symmetric memory (CPU tests replace this function)."""
    import torch.distributed._symmetric_memory as symm_mem
    from torch._C._autograd import DeviceType
    from torch._C._distributed_c10d import _SymmetricMemory

    for name in ("empty", "rendezvous"):
        if not hasattr(symm_mem, name):
            raise ImportError(f"this torch ({torch.__version__}) has no symm_mem.{name}")
    return symm_mem, _SymmetricMemory, DeviceType


def probe(device: torch.device | int | str | None, nodes: int) -> MulticastFacts:
    """This rank's facts for multimem_backend_refusal: whether torch symmetric memory can serve
    the device, whether torch reports multicast support for it, its compute capability. Queries
    only (nothing is allocated or mapped); a failing query is a fact ("unavailable"), never a
    raise, so that every rank reaches the agreement."""
    if isinstance(device, int):
        device = torch.device("cuda", device)
    device = torch.device("cuda") if device is None else torch.device(device)
    error, multicast, capability = None, False, (0, 0)
    try:
        if device.type != "cuda":
            error = f"{device} is not a CUDA device"
        elif not torch.cuda.is_available():
            error = "CUDA is not available"
        elif not dist.is_available():
            error = "torch.distributed is not available"
        else:
            index = device.index if device.index is not None else torch.cuda.current_device()
            device = torch.device("cuda", index)
            _, symm, device_type = _symm_mem_api()
            multicast = bool(symm.has_multicast_support(device_type.CUDA, index))
            capability = tuple(torch.cuda.get_device_capability(index))
    except Exception as exc:  # an import or driver error is a refusal here, not a raise
        error = f"{type(exc).__name__}: {exc}"
    return MulticastFacts(str(device), error, multicast, nodes, capability)


def agreed_refusal(group: dist.ProcessGroup | None, device: torch.device | int | str | None,
                   requested: str = MULTIMEM,
                   env: Mapping[str, str] | None = None) -> Refusal | None:
    """Collective (two all_gather_object): every rank evaluates multimem_backend_refusal (the
    node count from the group's host names) and every rank returns the same answer: None if no
    rank refuses, else the refusal with the earliest condition (lowest rank among equals), its
    reason ending in "(rank R)"."""
    env = os.environ if env is None else env
    world = dist.get_world_size(group)
    hosts: list[str | None] = [None] * world
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    nodes = len(set(hosts))
    mine = multimem_backend_refusal(requested, env, lambda: probe(device, nodes))
    everyone: list[tuple[int, str] | None] = [None] * world
    dist.all_gather_object(everyone, None if mine is None else tuple(mine), group=group)
    refused = [(r[0], rank, r[1]) for rank, r in enumerate(everyone) if r is not None]
    if not refused:
        return None
    code, rank, reason = min(refused)
    return Refusal(code, f"{reason} (rank {rank})")


def mapping_problem(per_rank: list[tuple[int, int, int]]) -> str | None:
    """What makes the ranks' torch symmetric-memory mappings unusable for the multimem kernel
    (None: usable), from every rank's (offset of its tensor into its allocation as the handle's
    buffer_ptrs show it, the handle's own `offset`, multicast_ptr). An offset is refused because
    torch versions differ in whether multicast_ptr includes it (a wrong multicast address would
    corrupt data silently)."""
    for rank, (offset, handle_offset, mc) in enumerate(per_rank):
        if offset or handle_offset:
            return (f"rank {rank}'s buffer lies {offset or handle_offset} bytes into its torch "
                    "symmetric-memory allocation, so its multicast address is ambiguous; create "
                    "the communicator before other symmetric-memory tensors")
        if not mc:
            return (f"torch made no multicast mapping on rank {rank} (multicast_ptr is 0) "
                    "although it reported multicast support")
    return None


class MulticastBuffer(PeerBuffer):
    """A PeerBuffer over torch symmetric memory, with `multicast_base` set (the SM path of a
    kernels.KernelComm over it runs the multimem kernel). Same constructor as SymmetricBuffer.
    Collective; refused on every rank (TokenWeaveInputError) unless every condition of
    multimem_backend_refusal holds on every rank (the opt-in and kill switches read from
    os.environ), before the extension is loaded or anything allocated. Untested on hardware here.

    `close()` drops this object's references to the memory; it returns to torch's symmetric-memory
    pool once no view of `local` or `signal` is left (views stay valid until then).
    """

    def _admit(self, group: dist.ProcessGroup | None,
               device: torch.device | int | str | None) -> None:
        refusal = agreed_refusal(group, device, MULTIMEM, os.environ)
        if refusal is not None:
            raise TokenWeaveInputError(f"multimem buffer refused: {refusal.reason}")

    def _map(self) -> None:
        ops = torch.ops.tokenweave
        dev = self.device.index
        symm_mem, _, _ = _symm_mem_api()
        with torch.cuda.device(dev):
            tensor = symm_mem.empty(self.signal_bytes + self.nbytes, dtype=torch.uint8,
                                    device=self.device)
            tensor.zero_()  # as ipc_malloc's memset: the signal pad starts at zero
            torch.cuda.synchronize(dev)
            ops.init_header(tensor.data_ptr(), dev)
            group = self.group if self.group is not None else dist.group.WORLD
            handle = symm_mem.rendezvous(tensor, group)
        ptrs = [int(p) for p in handle.buffer_ptrs]
        mine = (tensor.data_ptr() - ptrs[self.rank], int(getattr(handle, "offset", 0) or 0),
                int(handle.multicast_ptr or 0))
        everyone: list[tuple[int, int, int] | None] = [None] * self.world
        dist.all_gather_object(everyone, mine, group=self.group)
        problem = mapping_problem(everyone)
        if problem is not None:
            raise TokenWeaveInputError(f"multimem buffer refused: {problem}")
        self._tensor, self._handle = tensor, handle
        self._set_addresses(ptrs)
        self.multicast_base = mine[2] + self.signal_bytes
        self.signal = tensor[:self.signal_bytes]
        self.local = tensor[self.signal_bytes:]

    def _release(self) -> None:
        self._tensor = None
        self._handle = None
