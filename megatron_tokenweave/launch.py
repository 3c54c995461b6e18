"""Spawn one process per TP rank (gloo on CPU, NCCL on GPUs) and collect what each returns."""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Never NVLink multicast on our machines (DEVICE.md); spawned ranks inherit these.
NO_MULTICAST_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def free_port() -> int:
    """A free TCP port on the loopback interface (for a rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int, world: int, port: int, backend: str, fn: Callable, args: tuple, queue
) -> None:
    os.environ.update(NO_MULTICAST_ENV)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world)
        queue.put((rank, "ok", fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(
    fn: Callable, world: int = 2, *args: Any, backend: str | None = None, timeout: float = 600.0
) -> list[Any]:
    """Run fn(rank, world, *args) on `world` ranks; return the per-rank results or raise."""
    backend = backend or ("nccl" if torch.cuda.device_count() >= world else "gloo")
    os.environ.update(NO_MULTICAST_ENV)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world, port, backend, fn, args, queue))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world):
            rank, status, value = queue.get(timeout=timeout)
            if status == "error":
                errors.append(f"rank {rank}:\n{value}")
                break
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 60)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("a rank failed:\n" + "\n".join(errors))
    return [results[r] for r in range(world)]


def initialize_model_parallel(tensor_model_parallel_size: int, seed: int = 1234) -> None:
    """Megatron's parallel state (in a spawned rank) and its inference RNG tracker: no
    dropout-RNG forks, which works on CPU and inside CUDA-graph capture."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_model_parallel_size)
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)
