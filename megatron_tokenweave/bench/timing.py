"""Ratios measured in one run: candidates timed interleaved, with CUDA events, after a warm-up."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def capture_graph(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """fn() captured in a CUDA graph, after one eager run on a side stream (cuBLAS picks its
    kernels and workspace, the allocator warms up, outside the capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def interleaved_medians(
    candidates: dict[str, Callable[[int], object]], iters: int = 20, warmup: int = 5
) -> dict[str, float]:
    """Median microseconds of each candidate; candidate(i) gets the iteration index so it can
    rotate its inputs. Every iteration runs every candidate once, in turn, so clock drift and
    thermal state hit them alike, starting one candidate later each time (`rotation`): in a
    fixed order a 10-25 us GEMM's ratio moved by up to 1 % with its place (one H200,
    docs/kernel.md; what the previous candidate leaves behind, not told apart)."""
    for i in range(warmup):
        for fn in candidates.values():
            fn(i)
    torch.cuda.synchronize()
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    for i in range(iters):
        for name in rotation(list(candidates), i):
            fn = candidates[name]
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(i)
            end.record()
            end.synchronize()
            samples[name].append(start.elapsed_time(end) * 1e3)
    return {name: statistics.median(values) for name, values in samples.items()}


def rotation(names: list[str], i: int) -> list[str]:
    """Iteration i's order: `names` begun at entry i mod len(names), so over len(names)
    iterations every candidate runs once in every place."""
    k = i % len(names) if names else 0
    return names[k:] + names[:k]
