"""Communication buffers of one TP group, sized once: row-parallel GEMMs write partial sums here and
the fused op writes normed rows here, so the hot path neither allocates nor copies into comm
buffers.
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_tokenweave.log import log_once
from megatron_tokenweave.ops.validate import MAX_HIDDEN, MAX_RANKS, TokenWeaveInputError

if TYPE_CHECKING:
    from megatron_tokenweave import kernels


class WorkspaceCapacityError(TokenWeaveInputError):
    """A forward has more token rows than the workspace was sized for."""


def _peer_reachable(group: dist.ProcessGroup, device: torch.device) -> tuple[bool, str]:
    """True when every rank of `group` is a GPU of this node that this GPU can access directly."""
    world = dist.get_world_size(group)
    mine = (socket.gethostname(), device.index if device.index is not None else -1)
    everyone: list[tuple[str, int] | None] = [None] * world
    dist.all_gather_object(everyone, mine, group=group)
    hosts = {entry[0] for entry in everyone if entry is not None}
    if len(hosts) != 1:
        return False, f"the TP group spans {len(hosts)} nodes"
    for _, index in everyone:
        if index != mine[1] and not torch.cuda.can_device_access_peer(mine[1], index):
            return False, f"GPU {mine[1]} has no peer access to GPU {index}"
    return True, ""


def resolve_backend(requested: str, group: dist.ProcessGroup, device: torch.device,
                    hidden: int) -> str:
    """Pick "kernel" or "reference" for `requested` in {auto, kernel, reference} (collective:
    every rank takes the same branches, their conditions being the same on every rank)."""
    if requested == "reference":
        return "reference"
    from megatron_tokenweave import kernels

    world = dist.get_world_size(group)
    usable, why = (False, "the device is not a CUDA GPU")
    if world > MAX_RANKS:
        why = f"TP size {world} is above the kernel's {MAX_RANKS} ranks"
    elif hidden > MAX_HIDDEN:
        why = f"hidden size {hidden} is above the kernel's {MAX_HIDDEN}"
    elif device.type == "cuda":
        usable = kernels.is_available()
        why = "" if usable else "the CUDA extension megatron_tokenweave._C could not be loaded"
        if usable:
            usable, why = _peer_reachable(group, device)
    if usable:
        return "kernel"
    if requested == "kernel":
        raise RuntimeError(f"TokenWeave backend 'kernel' was requested but cannot run: {why}")
    log_once(f"backend:{why}", f"TokenWeave: using the torch.distributed reference op ({why})")
    return "reference"


class Workspace:
    """`partial` and `normed`: [max_tokens, hidden] buffers of one (group, dtype, hidden, device).

    On the kernel backend both live in one symmetric (CUDA IPC) allocation mapped on every rank.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        max_tokens: int,
        hidden: int,
        dtype: torch.dtype,
        device: torch.device,
        backend: str,
    ) -> None:
        self.group = group
        self.max_tokens = max_tokens
        self.hidden = hidden
        self.dtype = dtype
        self.backend = resolve_backend(backend, group, device, hidden)
        numel = max_tokens * hidden
        self.symmetric = None
        if self.backend == "kernel":
            from megatron_tokenweave import kernels

            nbytes = 2 * numel * torch.finfo(dtype).bits // 8
            self.symmetric = kernels.SymmetricBuffer(group, nbytes, device)
            flat = self.symmetric.local[:nbytes].view(dtype)
        else:
            flat = torch.empty(2 * numel, dtype=dtype, device=device)
        self.partial = flat[:numel].view(max_tokens, hidden)
        self.normed = flat[numel:].view(max_tokens, hidden)
        self._mirror = None  # copy_engine_mirror(), made on the first copy-engine call
        # The kernel's error words, copied here without a sync (see raise_if_kernel_failed).
        self._error_host = (
            torch.zeros(4, dtype=torch.int32, pin_memory=True) if self.symmetric else None
        )

    def raise_if_kernel_failed(self) -> None:
        """Raise if a kernel of an earlier forward gave up waiting for a peer rank.

        Never synchronizes: each call reads the error words that an earlier call asked to be
        copied to pinned host memory, then queues the next copy. A timeout therefore surfaces one
        forward late, as a RuntimeError instead of silently wrong results. Not checked while a
        CUDA graph is being captured (use SymmetricBuffer.check_error after replays).
        """
        if self.symmetric is None or torch.cuda.is_current_stream_capturing():
            return
        message = self.symmetric.describe_error(*self._error_host.tolist())
        if message is not None:
            raise RuntimeError(message)
        self._error_host.copy_(self.symmetric.error_words(), non_blocking=True)

    def copy_engine_mirror(self) -> kernels.CopyEngineMirror:
        """The local mirror of the peers' partial region for the copy-engine data path
        (kernels.CopyEngineMirror, (TP size - 1) x the partial region), allocated on first use.
        Not during a CUDA graph capture (its memory would belong to the graph's pool): a
        capture needs one eager forward of the same plan first, as every warm-up gives."""
        if self._mirror is None:
            if torch.cuda.is_current_stream_capturing():
                raise TokenWeaveInputError(
                    "the copy-engine mirror is allocated on the first eager call; run one "
                    "forward with comm='copy_engine' before capturing a CUDA graph")
            from megatron_tokenweave import kernels

            self._mirror = kernels.CopyEngineMirror(
                self.symmetric, self.partial.numel() * self.partial.element_size())
        return self._mirror

    def is_buffer_size_sufficient(self, rows: int) -> bool:
        return rows <= self.max_tokens

    def check_capacity(self, rows: int) -> None:
        if not self.is_buffer_size_sufficient(rows):
            raise WorkspaceCapacityError(
                f"this forward has {rows} token rows but the TokenWeave workspace holds "
                f"{self.max_tokens}; raise TokenWeaveConfig.max_tokens (TOKENWEAVE_MAX_TOKENS)"
            )

    def destroy(self) -> None:
        if self.symmetric is not None:
            self.symmetric.close()  # synchronizes: no copy into the mirror is still running
            self.symmetric = None
        self._mirror = None


_workspaces: dict[tuple, Workspace] = {}
# Workspaces outgrown by a larger max_tokens: kept until destroy_workspaces(), since CUDA graphs
# captured on them (and their copy-engine mirrors) replay with their addresses.
_outgrown: list[Workspace] = []


def get_workspace(
    group: dist.ProcessGroup,
    max_tokens: int,
    hidden: int,
    dtype: torch.dtype,
    device: torch.device,
    backend: str,
) -> Workspace:
    """The workspace of this group/dtype/hidden/device, created on first use (a collective).
    Every woven layer of a key shares it (a layer hands its normed rows to the next in it); a
    larger max_tokens replaces it with a larger one and keeps the old one alive."""
    key = (group, hidden, dtype, device, backend)
    ws = _workspaces.get(key)
    if ws is None or ws.max_tokens < max_tokens:
        if ws is not None:
            log_once(f"outgrown:{key}:{max_tokens}",
                     f"TokenWeave: a workspace of {ws.max_tokens} rows is outgrown by "
                     f"max_tokens={max_tokens}; both stay allocated (give every model the "
                     f"largest max_tokens to avoid it)")
            _outgrown.append(ws)
        ws = _workspaces[key] = Workspace(group, max_tokens, hidden, dtype, device, backend)
    return ws


def destroy_workspaces() -> None:
    """Free every workspace (a collective of each TP group; before destroying process groups).
    Nothing captured on them may replay afterwards."""
    for ws in [*_workspaces.values(), *_outgrown]:
        ws.destroy()
    _workspaces.clear()
    _outgrown.clear()
