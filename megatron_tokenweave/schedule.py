"""The woven schedule's building blocks: where tokens are split, the side stream, and the hand-off
of half-finished work from one layer to the next (one WeaveChain per decoder block).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from megatron_tokenweave.config import TokenWeaveConfig


@dataclass(frozen=True)
class Half:
    """Rows [offset, offset + rows) of every chunk (a chunk: one rank's shard, or all rows)."""

    offset: int
    rows: int

    def of(self, t: torch.Tensor) -> torch.Tensor:
        """This half's rows of a [chunks, rows_per_chunk, ...] tensor (a view)."""
        return t[:, self.offset : self.offset + self.rows]


def plan_halves(rows_per_chunk: int, cfg: TokenWeaveConfig, split: bool,
                granule: int = 1) -> tuple[Half, ...]:
    """One half when the plan does not split (policy.SplitPolicy.plan decides), else two, the
    first aligned for GEMM waves (cfg's split_align / split_offset) and a multiple of `granule`
    rows (FP8 GEMMs': fp8_gemm.FP8_ROWS), which the caller makes rows_per_chunk too. A chunk
    of fewer than 2 granules is never split."""
    n = rows_per_chunk
    if n < 2 * granule or not split:
        return (Half(0, n),)
    first = (n // 2) // cfg.split_align * cfg.split_align + cfg.split_offset
    if not 0 < first < n:
        first = n // 2
    first = first // granule * granule
    if first == 0:
        first = granule
    return (Half(0, first), Half(first, n - first))


class SideStream:
    """A higher-priority CUDA stream for communication, with a small ring of reusable events.

    On CPU every method is a no-op and the work runs inline, so the schedule is device-agnostic.
    Streams are looked up by device index and switched with torch.cuda.set_stream: without an
    index torch.cuda.current_stream() checks CUDA's availability on every call, and the
    torch.cuda.stream() context looks the current stream up that way too (a dozen such calls
    per woven layer in eager forwards, where host time is the budget).
    """

    RING = 16

    def __init__(self, device: torch.device) -> None:
        self.enabled = device.type == "cuda"
        if self.enabled:
            _, high = torch.cuda.Stream.priority_range()
            self.stream = torch.cuda.Stream(device=device, priority=high)
            self.index = self.stream.device_index
            self._events = [torch.cuda.Event() for _ in range(self.RING)]
            self._next = 0

    def _event(self) -> torch.cuda.Event:
        ev = self._events[self._next]
        self._next = (self._next + 1) % self.RING
        return ev

    @contextlib.contextmanager
    def run(self) -> Iterator[None]:
        """Run the body on the side stream after the work queued so far on the current stream."""
        if not self.enabled:
            yield
            return
        main = torch.cuda.current_stream(self.index)
        fork = self._event()
        fork.record(main)
        self.stream.wait_event(fork)
        device = torch.cuda.current_device()  # set_stream makes the stream's device current
        torch.cuda.set_stream(self.stream)
        try:
            yield
        finally:
            torch.cuda.set_stream(main)
            if device != self.index:
                torch.cuda.set_device(device)

    def record(self) -> torch.cuda.Event | None:
        """An event marking the side stream's work so far (None on CPU)."""
        if not self.enabled:
            return None
        ev = self._event()
        ev.record(self.stream)
        return ev

    @staticmethod
    def wait(event: torch.cuda.Event | None) -> None:
        """Make the current stream wait for `event` (no host synchronisation)."""
        if event is not None:
            torch.cuda.current_stream(torch.cuda.current_device()).wait_event(event)


@dataclass
class Pending:
    """One half's fused op as its consumer sees it: the side-stream event to wait for, and the
    work still to issue on the consumer's stream after it, once (the copy-engine op's local
    reduction, which must not run beside a GEMM). Pending() is already done."""

    event: torch.cuda.Event | None = None
    finish: Callable[[], None] | None = None

    def wait(self) -> None:
        """Make the current stream wait for the op; issue its remaining work the first time."""
        SideStream.wait(self.event)
        finish, self.finish = self.finish, None
        if finish is not None:
            finish()


@dataclass
class Handoff:
    """What a layer leaves its successor: the residual it returned, the successor's normed input
    ([chunks, rows, H], written on the side stream) and, per half, the op still writing them;
    `written`: that input as the ops wrote it in FP8 for the successor's first linear
    (linears.WrittenInput; the bf16 rows are then not written), or None; `reads`: what else
    those ops read (a one-stage layer's input residual), held until the successor is done.

    Why `reads`: the caller frees a layer's input once the layer returns (Megatron's stacks
    rebind hidden_states), and the caching allocator hands freed memory to the next
    allocations on the main stream at once; a pending side-stream op still reading it would
    then read the successor's activations (a HybridModel stack, FP8 tensorwise, two ranks on
    one H200: error 0.64-0.89 against the stock stack's 0.12)."""

    residual: torch.Tensor
    normed: torch.Tensor
    halves: tuple[Half, ...]
    pending: tuple[Pending, ...]
    written: Any = None
    reads: tuple[torch.Tensor, ...] = ()

    def wait(self) -> None:
        """The current stream waits until the hand-off's residual and normed rows are written."""
        for op in self.pending:
            op.wait()


class WeaveChain:
    """State shared by the TokenWeave layers of one decoder block.

    Layers built one after another with consecutive numbers join the chain of their predecessor,
    so layer i knows layer i+1's input norm and can fuse it into its post-MLP op. At run time
    every hand-off is checked by tensor identity: a layer that is given anything but what its
    predecessor returned waits for the pending work and normalizes its input itself.
    """

    def __init__(self) -> None:
        self._successor: dict[int, weakref.ReferenceType] = {}
        self.pending: Handoff | None = None
        self.side: SideStream | None = None

    def link(self, prev_layer: torch.nn.Module, layer: torch.nn.Module) -> None:
        self._successor[id(prev_layer)] = weakref.ref(layer)

    def successor(self, layer: torch.nn.Module) -> torch.nn.Module | None:
        ref = self._successor.get(id(layer))
        return ref() if ref is not None else None

    def side_stream(self, device: torch.device) -> SideStream:
        if self.side is None:
            self.side = SideStream(device)
        return self.side

    def claim(self, hidden_states: torch.Tensor) -> Handoff | None:
        """The pending hand-off if it was made for `hidden_states`; else settle it, return None."""
        pending = self.pending
        if pending is not None and pending.residual is hidden_states:
            self.pending = None
            return pending
        self.settle()
        return None

    def settle(self) -> None:
        """Wait (on the current stream) for a hand-off nobody claimed."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.wait()
