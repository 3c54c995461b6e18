"""The GEMM-fused mechanism's inbox: a second peer-mapped (CUDA IPC) buffer per communicator into
which every rank's row-parallel GEMM stores the output tiles other ranks own.

Layout of each rank's data region (ops/segments.py names the geometry):

    flags    int32 [SETS][world][blocks][tiles]    flag[s][src][m][n] = epoch: rank src stored
                                                   tile (m, n) of this rank's segment in set s
    control  int32 [2 * SETS + SETS * MAX_RANKS]   epoch[s] (the last call's), done[s], then
                                                   tag[s][src]: the call tag of src's flags
    slots    T [world][slot_rows][hidden]          slot src: the rows rank src stored here

Beside the regions, on an sm_90 GPU (the fitted kernel's), each set's split-K work (local, never
mapped): a flag and a tile's fp32 sums per CTA (ops/segments.split_k_tiles, fit_gemm.cuh
split_store), the flags zero between calls. A set's own, so the woven halves' GEMMs never share
them.

`GemmInbox.create` maps every rank's region (a collective: `Communicator.prepare_gemm`, which
every rank's plan reaches in the same forward); memory starts zeroed (epoch 0 = no call yet).
`GemmInbox.loopback` is the one-GPU benchmark's stand-in: every "rank" a separate local
allocation, so the GEMM's remote tiles and flags land in memory other than its own slot, as they
would over NVLink (no protocol runs on it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron_tokenweave.ops.segments import (
    MIN_BLOCK_COLS,
    MIN_BLOCK_ROWS,
    SETS,
    SPLIT_SLOT_FLOATS,
    slot_rows,
)
from megatron_tokenweave.ops.validate import MAX_RANKS, TokenWeaveInputError

_ALIGN = 256


class GemmInbox:
    """Every rank's inbox region as this rank addresses it: `bases` (each rank's region, flags
    first, slots at `slots_off`), this rank's `control` words and `slots` view."""

    def __init__(self, world: int, rank: int, max_tokens: int, hidden: int, dtype: torch.dtype,
                 map_regions: Callable[[int], tuple[list[int], list[torch.Tensor | None]]],
                 close: Callable[[], None]) -> None:
        self.world, self.rank, self.hidden, self.dtype = world, rank, hidden, dtype
        self.slot_rows = rows = slot_rows(max_tokens, world)
        self.flag_blocks = -(-self.slot_rows // MIN_BLOCK_ROWS)
        self.flag_tiles = -(-hidden // MIN_BLOCK_COLS)
        self.set_words = world * self.flag_blocks * self.flag_tiles
        flag_bytes = SETS * self.set_words * 4
        self.control_off = flag_bytes
        self.tags_off = flag_bytes + 4 * 2 * SETS  # bytes from a region's base: tag[0][0]
        control_words = 2 * SETS + SETS * MAX_RANKS
        self.slots_off = -(-(flag_bytes + 4 * control_words) // _ALIGN) * _ALIGN
        es = torch.finfo(dtype).bits // 8
        nbytes = self.slots_off + world * rows * hidden * es
        bases, raw = map_regions(nbytes)  # raw: each rank's region as a tensor, where held
        local = raw[rank]
        self._close = close
        self.bases = list(bases)
        self.control = local[self.control_off:self.control_off + 4 * control_words].view(
            torch.int32)
        # Each rank's slots where this process holds their memory (every rank's in a loopback
        # inbox, where the benchmark checks what landed; elsewhere this rank's only).
        self.owner_slots = [r[self.slots_off:nbytes].view(dtype).view(world, rows, hidden)
                            if r is not None else None for r in raw]
        self.slots = self.owner_slots[rank]
        self._split = _split_work(local.device)

    @classmethod
    def create(cls, group: dist.ProcessGroup, max_tokens: int, hidden: int, dtype: torch.dtype,
               device: torch.device, timeout_s: float) -> GemmInbox:
        """Every rank's inbox over CUDA IPC (collective)."""
        from megatron_tokenweave.kernels.symmetric import SymmetricBuffer

        buffers: list[SymmetricBuffer] = []

        def map_regions(nbytes: int) -> tuple[list[int], list[torch.Tensor | None]]:
            buffers.append(buffer := SymmetricBuffer(group, nbytes, device, timeout_s=timeout_s,
                                                     header=False))
            return list(buffer.peer_data), [buffer.local if q == buffer.rank else None
                                            for q in range(buffer.world)]

        return cls(dist.get_world_size(group), dist.get_rank(group), max_tokens, hidden, dtype,
                   map_regions, lambda: buffers[0].close())

    @classmethod
    def loopback(cls, world: int, max_tokens: int, hidden: int, dtype: torch.dtype,
                 device: torch.device) -> GemmInbox:
        """Rank 0 of `world` whose peers' inboxes are local allocations (benchmarks only)."""
        regions: list[torch.Tensor] = []

        def map_regions(nbytes: int) -> tuple[list[int], list[torch.Tensor | None]]:
            regions.extend(torch.zeros(nbytes, dtype=torch.uint8, device=device)
                           for _ in range(world))
            return [r.data_ptr() for r in regions], list(regions)

        return cls(world, 0, max_tokens, hidden, dtype, map_regions, regions.clear)

    def attach(self, handle: int) -> None:
        """Hand the inbox to the C++ communicator (its consumer reads this rank's part and,
        where it releases the GEMM's tiles, stores flags into every rank's)."""
        base = self.bases[self.rank]
        torch.ops.tokenweave.comm_attach_inbox(
            handle, base + self.slots_off, self.slot_rows, self.hidden * self.slots.element_size(),
            base, self.flag_blocks, self.flag_tiles, base + self.control_off, self.bases)

    def split_work(self, set_index: int) -> list[torch.Tensor]:
        """Set `set_index`'s split-K flags and sums (fit_gemm's `split`)."""
        if self._split is None:
            raise TokenWeaveInputError("split K runs in the fitted kernel, on an sm_90 GPU")
        return self._split[set_index]

    def close(self) -> None:
        """Free the regions (a collective for `create`'s)."""
        self._close()


def _split_work(device: torch.device) -> list[list[torch.Tensor]] | None:
    """Each set's split-K work on an sm_90 device (a flag and SPLIT_SLOT_FLOATS sums a CTA, as
    many CTAs as SMs), else None."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
        return None
    ctas = torch.cuda.get_device_properties(device).multi_processor_count
    return [[torch.zeros(ctas, dtype=torch.int32, device=device),
             torch.empty(ctas * SPLIT_SLOT_FLOATS, dtype=torch.float32, device=device)]
            for _ in range(SETS)]
