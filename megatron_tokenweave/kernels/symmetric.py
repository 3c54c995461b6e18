"""Symmetric buffer on plain CUDA IPC: one cudaMalloc per rank, mapped into every peer.

Works where NCCL and torch symmetric memory refuse (two ranks sharing one GPU): handles are
exchanged with all_gather_object over any process group (gloo or NCCL). Each rank's allocation is
[header (signal_pad_bytes()) | data (nbytes)]; the kernels address a peer's copy of a tensor as
peer_data_base[p] + (tensor.data_ptr() - local_data_base). PeerBuffer holds what the kernels use of
any such buffer (addressing, error words, lifetime); kernels.multicast.MulticastBuffer is the same
over torch symmetric memory, with a multicast address.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_tokenweave.kernels._ext import load_extension
from megatron_tokenweave.ops.validate import MAX_CTAS

# How long a kernel waits for a peer before it records an error and writes NaN (the
# communicator's agreed TOKENWEAVE_KERNEL_TIMEOUT_S overrides it).
DEFAULT_TIMEOUT_S = 10.0
_ALIGN = 256
_ERRORS = {1: "START barrier", 2: "END barrier", 3: "one-shot exchange (its rows never came)",
           4: "GEMM-fused reduction (its GEMM tiles never came)"}
CALL_MISMATCH = 5  # signal.cuh kCallMismatch: a peer published another call's tag or epoch
ERROR_WORDS = 8  # signal.cuh kErrorWords: code, peer, slot, epoch, peer epoch, tag, peer tag
# Barrier slots of the signal pad (signal.cuh): one per CTA index (kMaxCtas), then the
# copy-engine op's two (START/END, MID).
_CTA_SLOTS = MAX_CTAS
_SLOT_NAMES = {_CTA_SLOTS: "copy-engine op, START/END", _CTA_SLOTS + 1: "copy-engine op, MID"}


def resolve_device(device: torch.device | int | str | None) -> torch.device:
    """The CUDA device `device` names (None, or a device without an index: the current one)."""
    if device is None:
        idx = torch.cuda.current_device()
    elif isinstance(device, int):
        idx = device
    else:
        d = torch.device(device)
        idx = d.index if d.index is not None else torch.cuda.current_device()
    return torch.device("cuda", idx)


class PeerBuffer:
    """What the kernels use of a symmetric buffer: `nbytes` of peer-mapped device memory per rank
    of `group`, each rank's allocation laid out as [header | data]. The header is the kernels'
    signal pad plus the one-shot path's three 8 MiB receive buffers (`signal_bytes`, 24 MiB more
    per rank; never zero it by hand, "+0.0" reads as "arrived": recreate the buffer instead).

    Attributes: rank, world, device, nbytes, peer_allocs / peer_data (host: every rank's
    allocation / data-region base, as mapped here), local (uint8 CUDA tensor of the local data
    region: carve typed views with `.local[a:b].view(dtype).view(shape)`), local_base (int
    address of `local`), bases (CUDA int64 [2*world]: data bases, then signal-pad bases, in
    device memory), signal (uint8 CUDA tensor of the local header; None without one), timeout_s,
    multicast_base (None, or the multicast address of the data regions: only MulticastBuffer
    sets it).
    Call ops on one buffer in the same order on every rank, one at a time (one stream or ordered
    streams). Creating one and `close()` are collective. Subclasses map the memory in `_map`
    (SymmetricBuffer: CUDA IPC; kernels.multicast.MulticastBuffer: torch symmetric memory, after
    `_admit` agreed that it may) and free it in `_release`.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        nbytes: int,
        device: torch.device | int | str | None = None,
        *,
        timeout_s: float | None = None,
        header: bool = True,
    ) -> None:
        """Collective: `_admit` (may refuse on every rank), then `_map` maps the memory.
        header=False: data only, no signal pad (a buffer no kernel synchronizes or records
        errors in, such as the GEMM-fused inbox: 24 MiB less per rank)."""
        self._admit(group, device)
        load_extension()
        if nbytes <= 0:
            raise ValueError(f"nbytes must be positive, got {nbytes}")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.device = resolve_device(device)
        self.nbytes = (int(nbytes) + _ALIGN - 1) // _ALIGN * _ALIGN
        self.signal_bytes = int(torch.ops.tokenweave.signal_pad_bytes()) if header else 0
        self.timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else float(timeout_s)
        self.multicast_base: int | None = None
        self._closed = False
        self._map()
        dist.barrier(group=group)

    def _admit(self, group: dist.ProcessGroup | None,
               device: torch.device | int | str | None) -> None:
        """Before anything is loaded or allocated: raise on every rank if the buffer may not be
        made (a collective where it checks anything). Nothing to check by default."""

    def _map(self) -> None:
        """Allocate and map the memory; set local, signal and (by _set_addresses) the addresses."""
        raise NotImplementedError

    def _set_addresses(self, allocs: list[int]) -> None:
        """peer_allocs, peer_data, bases and local_base from every rank's allocation base (after
        `signal_bytes` is set)."""
        self.peer_allocs = allocs
        self.peer_data = [a + self.signal_bytes for a in allocs]
        self.bases = torch.tensor(self.peer_data + allocs, dtype=torch.int64, device=self.device)
        self.local_base = allocs[self.rank] + self.signal_bytes

    # -- addressing ---------------------------------------------------------------------------
    def offset_of(self, t: torch.Tensor) -> int:
        """Byte offset of t's first element from the local data base (may be out of range)."""
        return t.data_ptr() - self.local_base

    def contains(self, t: torch.Tensor) -> bool:
        """True if every element of t (with its strides) lies in the local data region."""
        if t.device != self.device:
            return False
        if t.numel() == 0:
            return 0 <= self.offset_of(t) <= self.nbytes
        lo = hi = 0
        for size, stride in zip(t.shape, t.stride(), strict=True):
            span = (size - 1) * stride
            lo, hi = (lo + span, hi) if span < 0 else (lo, hi + span)
        start = self.offset_of(t) + lo * t.element_size()
        end = self.offset_of(t) + (hi + 1) * t.element_size()
        return start >= 0 and end <= self.nbytes

    def view(self, dtype: torch.dtype, shape: tuple[int, ...], offset: int = 0) -> torch.Tensor:
        """A typed view of the data region at byte `offset` (must fit)."""
        n = 1
        for s in shape:
            n *= s
        es = torch.empty((), dtype=dtype).element_size()
        if offset < 0 or offset % _ALIGN or offset + n * es > self.nbytes:
            raise ValueError(f"view of {n * es} bytes at {offset} does not fit {self.nbytes} bytes")
        return self.local[offset:offset + n * es].view(dtype).view(shape)

    # -- errors -------------------------------------------------------------------------------
    def error_words(self) -> torch.Tensor:
        """The device's ERROR_WORDS error words (int32 view, no copy): code, peer, slot (CTA,
        row block or barrier slot), this rank's epoch (or round), and for a call mismatch the
        peer's epoch, this call's tag and the peer's."""
        if self.signal is None:
            raise RuntimeError("this buffer has no header (made with header=False): no error words")
        return self.signal.view(torch.int32)[:ERROR_WORDS]  # SignalPad begins with error[]

    def error(self) -> tuple[int, ...]:
        """The error words recorded by a kernel that gave up (all 0: none); syncs the device."""
        torch.cuda.synchronize(self.device)
        return tuple(int(x) for x in self.error_words().cpu().tolist())

    def describe_error(self, code: int, peer: int, slot: int, epoch: int, peer_epoch: int = 0,
                       tag: int = 0, peer_tag: int = 0, *_: int) -> str | None:
        """The message for error words read from the device (None when there is no error)."""
        if not code:
            return None
        where = f"row block {slot}" if code == 4 else _SLOT_NAMES.get(slot, f"CTA {slot}")
        if code == CALL_MISMATCH:
            where = _SLOT_NAMES.get(slot, f"CTA or row block {slot}")
            mask = 0xFFFFFFFF
            return (
                f"tokenweave kernel on rank {self.rank}: peer rank {peer} is on another call "
                f"({where}: its epoch/round {peer_epoch & mask}, tag {peer_tag & mask:#x}; this "
                f"rank's {epoch & mask}, tag {tag & mask:#x}); the ranks' calls diverged, and "
                "no rows of the two calls were combined (this rank's outputs are NaN)"
            )
        return (
            f"tokenweave kernel on rank {self.rank}: peer rank {peer} never arrived at the "
            f"{_ERRORS.get(code, '?')} ({where}, epoch/round {epoch & 0xFFFFFFFF}, timeout "
            f"{self.timeout_s} s); the ranks' calls diverged or a peer died"
        )

    def check_error(self) -> None:
        """Raise RuntimeError if a kernel on this rank gave up waiting for a peer. Syncs: for tests
        and debugging, not for the hot path. After an error the buffer is unusable (every later
        launch writes NaN into its outputs); create a new one."""
        message = self.describe_error(*self.error())
        if message is not None:
            raise RuntimeError(message)

    # -- lifetime -----------------------------------------------------------------------------
    def _release(self) -> None:
        """Unmap the peers and free this rank's memory (no collective)."""
        raise NotImplementedError

    def close(self) -> None:
        """Collective: wait until no rank uses the buffer, then unmap peers and free. Views of
        `local` must not be used afterwards."""
        if self._closed:
            return
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)
        self._release()
        self._closed = True

    def __enter__(self) -> PeerBuffer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(rank={self.rank}, world={self.world}, "
                f"device={self.device}, nbytes={self.nbytes})")


class SymmetricBuffer(PeerBuffer):
    """A PeerBuffer on plain CUDA IPC: one cudaMalloc per rank (zeroed), its handle exchanged with
    all_gather_object and opened on every peer. multicast_base stays None (never created here)."""

    def _map(self) -> None:
        """Each local step's outcome is exchanged before the next collective step: a rank whose
        allocation or mapping failed (e.g. out of memory) makes every rank raise, naming it,
        instead of leaving the others waiting."""
        ops = torch.ops.tokenweave
        dev = self.device.index
        self._alloc = 0
        self._opened: list[int] = []
        handle: bytes | str
        try:
            self._alloc = int(ops.ipc_malloc(self.signal_bytes + self.nbytes, dev))
            if self.signal_bytes:
                ops.init_header(self._alloc, dev)
            handle = bytes(ops.ipc_get_handle(self._alloc, dev).tolist())
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            handle = f"{type(exc).__name__}: {exc}"
        handles = self._everyone(handle, "allocating")
        allocs: list[int] = []
        failure = None
        try:
            for p, h in enumerate(handles):
                if p == self.rank:
                    allocs.append(self._alloc)
                else:
                    ptr = int(ops.ipc_open_handle(torch.tensor(list(h), dtype=torch.uint8), dev))
                    self._opened.append(ptr)
                    allocs.append(ptr)
        except Exception as exc:  # noqa: BLE001
            failure = f"{type(exc).__name__}: {exc}"
        self._everyone(failure, "mapping the peers' buffers")
        self._set_addresses(allocs)
        self.local = ops.tensor_from_ptr(self.local_base, self.nbytes, dev)
        self.signal = (ops.tensor_from_ptr(self._alloc, self.signal_bytes, dev)
                       if self.signal_bytes else None)

    def _everyone(self, mine: bytes | str | None, step: str) -> list:
        """Every rank's `mine` (all_gather_object); a str is a failure: release what this rank
        holds and raise on every rank, naming the ranks that failed."""
        everyone: list = [None] * self.world
        dist.all_gather_object(everyone, mine, group=self.group)
        failed = {p: e for p, e in enumerate(everyone) if isinstance(e, str)}
        if failed:
            self._release()
            raise RuntimeError(f"TokenWeave symmetric buffer: {step} failed on rank(s) "
                               + "; ".join(f"{p}: {e}" for p, e in sorted(failed.items())))
        return everyone

    def _release(self) -> None:
        ops = torch.ops.tokenweave
        dev = self.device.index
        for ptr in self._opened:
            ops.ipc_close_handle(ptr, dev)
        self._opened = []
        if self._alloc:
            ops.ipc_free(self._alloc, dev)
            self._alloc = 0
