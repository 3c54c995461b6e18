"""Local mirrors of the peers' partial rows for the copy-engine data path (csrc copy_engine.cuh).

The copy-engine op pulls the peers' rows with cudaMemcpyAsync into these mirrors (one per peer,
laid out like the first `nbytes` of the symmetric buffer's data region, where the workspace keeps
its partial sums), then runs the fused kernel over local memory only. Allocated once, next to
the symmetric buffer, never on the hot path.
"""

from __future__ import annotations

import torch

from megatron_tokenweave.kernels.symmetric import PeerBuffer


class CopyEngineMirror:
    """`nbytes` (rounded up to 256) of local device memory per peer of `buffer`'s group.

    Attributes: buffer, nbytes (mirrored prefix of the data region), mirror (uint8 tensor of
    (world - 1) * nbytes), mirrors (host: this rank's mirror of each rank, 0 for itself),
    sources (device int64 [2 * world]: the kernel's
    data bases on this path, own data base at `rank`, then the signal pads).
    """

    def __init__(self, buffer: PeerBuffer, nbytes: int) -> None:
        if not 0 < nbytes <= buffer.nbytes:
            raise ValueError(f"mirror of {nbytes} bytes: must be in (0, {buffer.nbytes}]")
        self.buffer = buffer
        self.nbytes = (int(nbytes) + 255) // 256 * 256  # every peer's slot 16-byte aligned
        world, rank = buffer.world, buffer.rank
        self.mirror = torch.empty((world - 1) * self.nbytes, dtype=torch.uint8,
                                  device=buffer.device)
        base = self.mirror.data_ptr()
        slots = [q if q < rank else q - 1 for q in range(world)]
        self.mirrors = [0 if q == rank else base + slots[q] * self.nbytes for q in range(world)]
        data = [buffer.local_base if q == rank else self.mirrors[q] for q in range(world)]
        self.sources = torch.tensor(data + buffer.peer_allocs, dtype=torch.int64,
                                    device=buffer.device)

    def covers(self, t: torch.Tensor) -> bool:
        """True if every element of t lies in the mirrored prefix of the buffer's data region."""
        return self.buffer.contains(t) and (
            self.buffer.offset_of(t) + t.numel() * t.element_size() <= self.nbytes)
