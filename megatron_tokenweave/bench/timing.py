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
    rotate its inputs. Every iteration runs every candidate once, so clock drift and thermal
    state hit them alike; iteration i in order i of `balanced_orders`, cyclically. Over whole
    cycles each candidate runs in every place and right after every other candidate equally
    often; fewer iterations (a tuner's 10 among 15 candidates) still give each candidate many
    different predecessors (7 of its 9 at 15 candidates and 10 iterations). Why: at 10-25 us
    GEMMs a candidate's time moved by up to 1.5 % with the candidate timed before it (the same
    kernel, timed right after cuBLAS and right after itself, one H200, docs/kernel.md), so no
    fixed order, nor a rotation of one, is fair."""
    if not candidates:
        return {}
    orders = balanced_orders(list(candidates))
    for i in range(warmup):
        for fn in candidates.values():
            fn(i)
    torch.cuda.synchronize()
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    for i in range(iters):
        for name in orders[i % len(orders)]:
            fn = candidates[name]
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(i)
            end.record()
            end.synchronize()
            samples[name].append(start.elapsed_time(end) * 1e3)
    return {name: statistics.median(values) for name, values in samples.items()}


def balanced_orders(names: list[str]) -> list[list[str]]:
    """A balanced Latin square of `names` (Williams' design): n orders for n candidates (2n
    where n is odd) in which every candidate holds every place, and follows every other
    candidate within an order, equally often."""
    n = len(names)
    first = [(j + 1) // 2 if j % 2 else (n - j // 2) % n for j in range(n)]
    rows = [[names[(k + r) % n] for k in first] for r in range(n)]
    return rows + [row[::-1] for row in rows] if n % 2 else rows
