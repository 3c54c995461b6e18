"""What Megatron-Core needs to run on a machine without CUDA (tests and the CPU example only).

Nothing here is active when CUDA is available: each scope checks `torch.cuda.is_available()`
and changes nothing on a GPU machine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


class _HostStream:
    """Stands in for torch.cuda.Stream when a module only creates one (Megatron's all-to-all MoE
    dispatcher makes a device-to-host copy stream that its drop-and-pad mode never uses)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass


@contextlib.contextmanager
def cpu_device_scope() -> Iterator[None]:
    """Make `torch.cuda.current_device()` answer "cpu", `torch.cuda.Stream()` build a stand-in
    and `torch.cuda.synchronize()` wait for nothing inside the scope, on CPU-only machines.

    Megatron builds RoPE and attention buffers on `torch.cuda.current_device()`; with this they
    land on the CPU. Its distributed checkpointing synchronizes the device before it copies
    tensors. On a machine with CUDA the scope changes nothing.
    """
    if torch.cuda.is_available():
        yield
        return
    saved = torch.cuda.current_device, torch.cuda.Stream, torch.cuda.synchronize
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.Stream = _HostStream  # type: ignore[assignment,misc]
    torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.current_device, torch.cuda.Stream, torch.cuda.synchronize = saved  # type: ignore[assignment,misc]


class _HostEvent:
    """Stands in for torch.cuda.Event on the CPU: work is synchronous, so it is always done."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, *args: Any) -> None:
        pass

    def wait(self, *args: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: _HostEvent) -> float:
        return 0.0


class _HostTorch:
    """`torch` for a module that hard-codes device="cuda" in torch.tensor: the CPU instead."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def tensor(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.tensor(*args, device="cpu" if device == "cuda" else device, **kwargs)


def _is_tensor(tensor: torch.Tensor | None) -> None:
    assert tensor is not None


def _causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


@contextlib.contextmanager
def cpu_inference_scope() -> Iterator[None]:
    """cpu_device_scope plus what Megatron's static inference engine and Flask server touch:
    `Tensor.cuda()` (kept on the CPU), `torch.cuda.Event` (always done, zero elapsed time),
    the unfused softmax's default causal mask
    (built on "cuda"), the inference broadcasts' "is this a CUDA tensor" assertion and the
    server's prompt tokenizer, which puts its tensors on "cuda"."""
    if torch.cuda.is_available():
        yield
        return
    from megatron.core.fusions import fused_softmax
    from megatron.core.inference import communication_utils
    from megatron.core.inference.text_generation_server import tokenization

    patches = [
        (torch.Tensor, "cuda", lambda self, *args, **kwargs: self),
        (torch.cuda, "Event", _HostEvent),
        (fused_softmax, "get_default_causal_mask", _causal_mask),
        (communication_utils, "_is_cuda", _is_tensor),
        (tokenization, "torch", _HostTorch()),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        with cpu_device_scope():
            yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
