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


def initialize_model_parallel(tensor_model_parallel_size: int, seed: int = 1234) -> None:
    """Megatron's parallel state and its inference RNG tracker (no dropout-RNG forks: works on
    CPU and inside CUDA-graph capture)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_model_parallel_size)
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)
