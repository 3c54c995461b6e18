"""What Megatron-Core needs to run on a machine without CUDA (tests and the CPU example only).

Nothing here is active when CUDA is available: the helpers check `torch.cuda.is_available()`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def cpu_device_scope() -> Iterator[None]:
    """Make `torch.cuda.current_device()` answer "cpu" inside the scope, on CPU-only machines.

    Megatron builds RoPE and attention buffers on `torch.cuda.current_device()`; with this they
    land on the CPU. On a machine with CUDA the scope changes nothing.
    """
    if torch.cuda.is_available():
        yield
        return
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.current_device = original  # type: ignore[assignment]
