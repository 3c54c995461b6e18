"""Spawn one process per TP rank (gloo on CPU, NCCL on GPUs), collect what each returns, and stop
the ranks together: a rank that fails or dies takes the others down at once, and SIGINT/SIGTERM
to the launcher stops every rank (a server finishes its request in flight) instead of leaving
ranks behind."""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import os
import pickle
import queue as queue_mod
import select
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
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
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # what the launcher takes as "stop"
# What the launcher sends a rank to stop it: a server (stop_event) finishes its request in
# flight and returns; any other rank dies at once (the default action), without the stack dump
# that Megatron's faulthandler registration prints on SIGTERM and SIGINT.
STOP_REQUEST = signal.SIGUSR1
_POLL_S = 0.2  # how often the launcher looks at its ranks while it waits
_JOIN_S = 30.0  # a rank that returned its result has this long to exit
_PR_SET_PDEATHSIG = 1

_STOP = threading.Event()


class RankFailed(RuntimeError):
    """A rank raised or died; the launcher stopped the others."""

    def __init__(self, rank: int, detail: str) -> None:
        self.rank, self.detail = rank, detail.strip()
        summary = self.detail.splitlines()[-1] if self.detail else "no detail"
        more = f"\n{self.detail}" if summary != self.detail else ""
        super().__init__(f"rank {rank} failed: {summary}{more}")


class Stopped(KeyboardInterrupt):
    """The launcher got SIGINT or SIGTERM and stopped every rank (a KeyboardInterrupt, so that
    `except Exception` never swallows it)."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")


def free_port() -> int:
    """A free TCP port on the loopback interface (for a rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _request_stop(signum: int, frame: Any) -> None:
    _STOP.set()


def stop_event() -> threading.Event:
    """Set once this process is asked to stop: what a long-running rank (a server) waits on.

    A call from the main thread makes STOP_REQUEST (the launcher's), SIGTERM, and SIGINT unless
    it is ignored (in ranks of `spawn`, whose launcher owns Ctrl-C) set it. It also takes these
    signals back from faulthandler, which Megatron's inference coordinator module registers on
    SIGTERM and SIGINT when it is imported (every stop would dump the stacks), so call it after
    Megatron's inference modules are imported."""
    if threading.current_thread() is threading.main_thread():
        for signum in (STOP_REQUEST, *STOP_SIGNALS):
            faulthandler.unregister(signum)
            if signal.getsignal(signum) is not signal.SIG_IGN:
                signal.signal(signum, _request_stop)
    return _STOP


def _die_with_launcher(forked: bool) -> None:
    """Linux: kill this rank when its launcher dies, even by SIGKILL: no rank outlives it.

    A spawned rank asks the kernel for SIGKILL when its parent, the launcher, dies. A rank
    started by the fork server (`forked`) has that server as its parent, which lives on while any
    of its ranks do: a thread waits on a pidfd of the launcher instead."""
    launcher = mp.parent_process()
    if launcher is None:
        return
    if forked:
        try:
            pidfd = os.pidfd_open(launcher.pid)
        except ProcessLookupError:  # it died already
            os._exit(1)
        except (OSError, AttributeError):  # no pidfds: the launcher's own handlers still stop ranks
            return
        threading.Thread(target=_kill_self_when_ready, args=(pidfd,), daemon=True,
                         name="tokenweave-launcher-watch").start()
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    except (OSError, AttributeError):  # not Linux: the launcher's own handlers still stop ranks
        return
    if os.getppid() != launcher.pid:  # it died before the prctl
        os._exit(1)


def _kill_self_when_ready(fd: int) -> None:
    """Block until `fd` (a pidfd: readable once that process has exited) is readable; then
    SIGKILL this process."""
    select.select([fd], [], [])
    os.kill(os.getpid(), signal.SIGKILL)


def _worker(
    rank: int, world: int, port: int, backend: str, fn: Callable, args: tuple, queue,
    env: dict[str, str], forked: bool,
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher owns Ctrl-C (see spawn)
    _die_with_launcher(forked)
    os.setpgrp()  # a terminal's Ctrl-C reaches the launcher only, which stops the ranks in order
    # The launcher's environment as it is now (a fork server's is the one it started with).
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world)
        if backend == "gloo":
            # gloo connects every pair at init; a rank whose fn returns at once and exits could
            # close a pair a slower rank is still connecting ("Connection closed by peer"):
            # no rank goes on before every rank's mesh is up.
            dist.barrier()
        # Plain pickle copies tensors into the message: torch's queue pickler would share their
        # storage through a file descriptor this process serves, gone once it exits below.
        queue.put((rank, "ok", pickle.dumps(fn(rank, world, *args))))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # The launcher has the result once the queue is flushed; skip the interpreter's teardown,
    # which takes seconds in a rank that loaded Megatron's inference stack.
    queue.close()
    queue.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _exit_detail(exitcode: int) -> str:
    if exitcode < 0:
        return f"killed by {signal.Signals(-exitcode).name} without reporting"
    return f"exited with code {exitcode} without reporting"


def _stop_ranks(procs: list, grace_s: float) -> None:
    """STOP_REQUEST to every live rank, then SIGKILL to what is left of each rank's process group
    after `grace_s` (the rank and any process it started: a server's frontends), and reap the
    ranks."""
    procs = [p for p in procs if p.pid is not None]  # started ones
    for p in procs:
        if p.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, STOP_REQUEST)
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)  # each rank leads its own group (_worker)
        if p.is_alive():  # not yet in its own group
            p.kill()
        p.join()


def spawn(
    fn: Callable,
    world: int = 2,
    *args: Any,
    backend: str | None = None,
    timeout: float | None = 600.0,
    stop_grace_s: float = 3.0,
    preload: Sequence[str] = (),
) -> list[Any]:
    """Run fn(rank, world, *args) on `world` ranks; return the per-rank results.

    `timeout=None` waits as long as the ranks run (a server). Raises RankFailed when a rank
    raises or dies (the others are killed at once), TimeoutError past `timeout`, and Stopped
    when the launcher gets SIGINT or SIGTERM: then every rank gets STOP_REQUEST (a server's
    stop_event) and `stop_grace_s` to return before it is killed. The ranks run in their own
    process group with SIGINT ignored, so a terminal's Ctrl-C reaches them only through the
    launcher.

    `preload`: modules the ranks of a CPU job (gloo) take from a fork server that imported them
    once per launcher process: a rank starts in a fraction of a second instead of importing torch
    and Megatron again (seconds of CPU each). Never with NCCL: the server must not touch a GPU.
    The ranks get the launcher's environment of the call either way; what a preloaded module
    read from the environment when it was imported stays as the server saw it."""
    backend = backend or ("nccl" if torch.cuda.device_count() >= world else "gloo")
    if preload and backend != "gloo":
        raise ValueError(f"preload is for gloo ranks on CPU, not backend {backend!r}: forked "
                         "ranks cannot use a GPU that their server's process could have touched")
    os.environ.update(NO_MULTICAST_ENV)
    forked = bool(preload)
    ctx = mp.get_context("forkserver" if forked else "spawn")
    if forked:
        ctx.set_forkserver_preload(list(preload))  # used when this process starts its server
    queue = ctx.Queue()
    port = free_port()
    env = dict(os.environ)
    procs = [
        ctx.Process(target=_worker,
                    args=(r, world, port, backend, fn, args, queue, env, forked))
        for r in range(world)
    ]
    owns_signals = threading.current_thread() is threading.main_thread()
    saved = {s: signal.getsignal(s) for s in STOP_SIGNALS} if owns_signals else {}
    received: list[int] = []
    try:
        if owns_signals:  # the ranks inherit an ignored SIGINT from the moment they start
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        for p in procs:
            p.start()
        for s in saved:
            signal.signal(s, lambda signum, frame: received.append(signum))
        results = _collect(procs, queue, timeout, received)
        if received:
            _stop_ranks(procs, stop_grace_s)
            raise Stopped(received[0])
        for p in procs:
            p.join(_JOIN_S)
    finally:
        _stop_ranks(procs, 0.0)  # whatever happened, no rank is left running
        for s, handler in saved.items():
            signal.signal(s, handler)
    return [results[r] for r in range(world)]


def _collect(procs: list, queue, timeout: float | None, received: list[int]) -> dict[int, Any]:
    """Wait for every rank's result, a stop signal (`received`), a failure or the timeout."""
    deadline = None if timeout is None else time.monotonic() + timeout
    results: dict[int, Any] = {}
    suspect: int | None = None  # a rank seen dead before its result was read
    while len(results) < len(procs) and not received:
        try:
            rank, status, value = queue.get(timeout=_POLL_S)
        except queue_mod.Empty:
            if suspect is not None:  # its last message would have arrived by now
                raise RankFailed(suspect, _exit_detail(procs[suspect].exitcode)) from None
            suspect = next((r for r, p in enumerate(procs)
                            if r not in results and p.exitcode is not None), None)
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the ranks did not finish within {timeout} s") from None
            continue
        if status == "error":
            raise RankFailed(rank, value)
        results[rank] = pickle.loads(value)
        suspect = None
    return results


def initialize_model_parallel(tensor_model_parallel_size: int, seed: int = 1234,
                              pipeline_model_parallel_size: int = 1) -> None:
    """Megatron's parallel state (in a spawned rank) and its inference RNG tracker: no
    dropout-RNG forks, which works on CPU and inside CUDA-graph capture. With pipeline
    parallelism the ranks are Megatron's default order: TP groups of consecutive ranks, one per
    stage."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size)
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)
