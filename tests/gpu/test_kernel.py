"""GPU tests of the fused all-reduce + residual + RMSNorm kernel (skip cleanly without GPUs).

* test_kernel_two_gpus: 2 ranks on 2 GPUs (NCCL), every case against ops/reference.py run over NCCL
  on the same inputs, outputs poisoned with NaN, on every data path (SM-driven bulk copies and
  registers, one-shot, copy engines, the copy-engine op as a transfer on a side stream and a
  reduction on the main stream); 10,000 consecutive calls and 1,000 CUDA-graph replays per path;
  two phased ops in flight, with a peer poisoning its partial before the other rank reduces;
  a peer that never arrives -> NaN outputs and check_error raises.
* test_kernel_protocol_one_gpu: 2 processes sharing one GPU (gloo + CUDA IPC): the inter-rank
  protocol on every data path (the phased copy-engine op included), bf16 and fp16, against a
  locally computed expectation, and the timeout path: eagerly and under CUDA-graph replay (the
  serving arrangement), a peer that skips a call gives NaN outputs and a RuntimeError naming the
  peer, the slot and the timeout; and divergence: a rank that misses one call of a numbered
  sequence, every path (one-shot, barrier / two-shot, sequence parallel, copy engine,
  GEMM-fused), eagerly and under graph replay: every later output is right or NaN, never
  wrong-but-finite, and every rank raises.
All cases of a test run inside one spawned job (one extension load, one process group).
"""

from __future__ import annotations

import functools
import itertools
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _rounding import ulp, within  # tests/ is on sys.path (conftest.py)

from megatron_tokenweave.launch import NO_MULTICAST_ENV, free_port

os.environ.update(NO_MULTICAST_ENV)

TOKENS = (1, 3, 64, 127, 128, 1000, 1024, 4096, 8192)
HIDDENS = (4096, 5120, 8192)
EPS = 1e-5


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _kernels_or_skip():
    if _gpus() == 0:
        pytest.skip("no CUDA GPU")
    from megatron_tokenweave import kernels

    try:
        kernels.load_extension()  # build once in the parent, before spawning
    except kernels.KernelUnavailableError as exc:
        pytest.skip(f"kernel extension unavailable: {exc}")
    return kernels


def _tol(dtype):
    return (dict(rtol=1.6e-2, atol=1e-2) if dtype == torch.bfloat16
            else dict(rtol=2e-3, atol=2e-3))


def _rows(tokens: int, world: int, sp: bool) -> int:
    """Rows per chunk of a case: small token counts are used as-is (n < P included)."""
    return tokens if (not sp or tokens < 128) else tokens // world


def _gen(seed: int, shape, dtype, device) -> torch.Tensor:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(dtype)


def _init(rank: int, world: int, port: int, backend: str, device: int):
    os.environ.update(NO_MULTICAST_ENV)
    torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=torch.device("cuda", device)
                            if backend == "nccl" else None)
    return dist.group.WORLD


def _case_tensors(buf, layout, n, hidden, dtype, world, rank, seed, weight_on, alias):
    from megatron_tokenweave.ops.validate import Layout

    dev = buf.device
    sp = layout is Layout.SEQUENCE_PARALLEL
    chunks = world if sp else 1
    es = torch.empty((), dtype=dtype).element_size()
    part = buf.view(dtype, (chunks, n, hidden), 0)
    part.copy_(_gen(seed * 16 + rank, (chunks, n, hidden), dtype, dev))
    res_seed = seed * 16 + 8 + (rank if sp else 0)  # replicated: same residual on every rank
    residual = _gen(res_seed, (n, hidden), dtype, dev)
    weight = (1.0 + 0.1 * _gen(seed * 16 + 15, (hidden,), dtype, dev)).to(dtype) if weight_on \
        else None
    normed = None
    if weight_on:
        if sp:  # a strided [P, n, H] view of a [P, n + 5, H] region: arbitrary chunk stride
            off = ((chunks * n * hidden * es + 255) // 256) * 256
            normed = buf.view(dtype, (chunks, n + 5, hidden), off)[:, :n]
        else:
            normed = torch.empty(chunks, n, hidden, dtype=dtype, device=dev)
        normed.fill_(float("nan"))
    residual_out = residual.clone() if alias else torch.full_like(residual, float("nan"))
    res_in = residual_out if alias else residual
    return part, res_in, weight, residual_out, normed, residual


# Communicator settings the tests compare, by name (every data path of the SM-driven kernels):
# "default" takes the one-shot path for small replicated calls, the two-shot path for the other
# replicated calls at TP >= 4, else the bulk-copy pipeline; the others force a path.
SETTINGS = {
    "default": {},
    "barrier": {"oneshot": False},  # replicated: two-shot at TP >= 4, pull-all below
    "pullall": {"oneshot": False, "twoshot": False},
    "registers": {"bulk": False, "oneshot": False, "twoshot": False},
}


def _comms(kernels, buf, mirror) -> dict:
    """One KernelComm per SETTINGS entry over the same buffer (the protocol state lives in the
    buffer's signal pad; a handle only describes it), each with the copy-engine mirror."""
    comms = {}
    for name, kwargs in SETTINGS.items():
        comms[name] = kernels.KernelComm(buf, kernels.KernelSettings(**kwargs))
        comms[name].attach_mirror(mirror)
    return comms


def _call(comm, args: tuple, ctas: int, copy_engine: bool, phased: bool,
          validate: bool = True):
    """The op on the current stream; `phased`: its copy-engine transfer on a side stream, the
    reduction back on the current stream after an event (the woven layer's arrangement)."""
    path = "copy_engine" if copy_engine else "sm"
    if not phased:
        comm.run(*args, ctas=ctas, path=path, validate=validate)
        return
    main, side = torch.cuda.current_stream(), _side_stream()
    side.wait_stream(main)
    with torch.cuda.stream(side):
        comm.run(*args, ctas=ctas, path=path, validate=validate, phase="transfer")
    main.wait_stream(side)
    comm.run(*args, ctas=ctas, path=path, validate=validate, phase="reduce")


@functools.cache
def _side_stream() -> torch.cuda.Stream:
    return torch.cuda.Stream(priority=torch.cuda.Stream.priority_range()[1])


def _worker_two_gpus(rank: int, world: int, port: int) -> None:
    from megatron_tokenweave import kernels
    from megatron_tokenweave.ops.reference import fused_allreduce_rmsnorm_reference
    from megatron_tokenweave.ops.validate import Layout, phases_apply

    group = _init(rank, world, port, "nccl", rank)
    dev = torch.device("cuda", rank)
    buf = kernels.SymmetricBuffer(group, 320 << 20, dev)
    mirror = kernels.CopyEngineMirror(buf, buf.nbytes)
    comms = _comms(kernels, buf, mirror)
    t0 = time.time()
    ncase = nphased = 0
    seed = 1
    for dtype in (torch.bfloat16, torch.float16):
        for layout in (Layout.SEQUENCE_PARALLEL, Layout.REPLICATED):
            for hidden in HIDDENS:
                for tokens in TOKENS:
                    for weight_on in (True, False):
                        seed += 1
                        n = _rows(tokens, world, layout is Layout.SEQUENCE_PARALLEL)
                        alias = seed % 2 == 0
                        ctas = (2, 8, 16, 32)[seed % 4]
                        part, res_in, w, res_out, normed, residual = _case_tensors(
                            buf, layout, n, hidden, dtype, world, rank, seed, weight_on, alias)
                        ref_res = torch.empty_like(residual)
                        ref_normed = torch.empty(part.shape, dtype=dtype, device=dev) \
                            if weight_on else None
                        fused_allreduce_rmsnorm_reference(part.clone(), residual, w, EPS, ref_res,
                                                          ref_normed, layout, group)
                        # Every third case on the register path (bulk off), the others on the
                        # bulk-copy pipeline; small replicated calls take the one-shot path
                        # unless the communicator has it off (every other case).
                        # A third of the blocks of 8 cases on the copy-engine path.
                        regs = seed % 3 == 0
                        no_oneshot = (seed // 4) % 2 == 1  # independent of ctas, weight, alias
                        ce = (seed // 8) % 3 == 0
                        # Every other copy-engine block of 8 (all ctas / alias / weight
                        # combinations), where it applies, as a transfer + a reduction; a
                        # quarter of those with 128 CTAs, as the shipped tables reduce.
                        phased = ce and (seed // 24) % 2 == 0 and phases_apply(layout, w)
                        if phased and seed % 8 >= 6:
                            ctas = 128
                        name = "registers" if regs else "barrier" if no_oneshot else "default"
                        _call(comms[name], (part, res_in, w, EPS, res_out, normed, layout), ctas,
                              ce, phased)
                        what = (f"rank {rank} {dtype} {layout.value} H={hidden} tokens={tokens} "
                                f"n={n} weight={weight_on} alias={alias} ctas={ctas} "
                                f"regs={regs} no_oneshot={no_oneshot} copy_engine={ce} "
                                f"phased={phased}")
                        torch.testing.assert_close(res_out, ref_res, **_tol(dtype), msg=what)
                        if weight_on:
                            torch.testing.assert_close(normed, ref_normed, **_tol(dtype), msg=what)
                        ncase += 1
                        nphased += phased
    assert nphased >= 8, nphased
    buf.check_error()
    t_cases = time.time() - t0

    # 10,000 consecutive calls and 1,000 graph replays, partial rewritten before every call:
    # the barrier path (sequence parallel, 256 rows), the one-shot path (replicated, 64 rows:
    # 10,000 rounds through its three receive buffers) and the copy-engine path (both layouts).
    loops = ((Layout.SEQUENCE_PARALLEL, 256, None, False), (Layout.REPLICATED, 64, None, False),
             (Layout.SEQUENCE_PARALLEL, 256, mirror, False),
             (Layout.REPLICATED, 1000, mirror, False), (Layout.REPLICATED, 1000, mirror, True))
    t_loops = [_consecutive_calls(buf, comms["default"], group, rank, dev, layout, n,
                                  m is not None, phased)
               for layout, n, m, phased in loops]
    _phased_in_flight(buf, comms["default"], group, rank, dev)
    buf.check_error()
    for comm in comms.values():
        comm.close()
    buf.close()

    _timeout_check(group, rank, dev)
    print(f"[rank {rank}] {ncase} cases in {t_cases:.1f}s, 10k calls in "
          + " / ".join(f"{t:.1f}s" for t in t_loops)
          + " (barrier, one-shot, copy engine sp, copy engine replicated, the same phased), "
          "graphs OK", flush=True)
    dist.destroy_process_group()


def _consecutive_calls(buf, comm, group, rank, dev, layout, n, copy_engine, phased) -> float:
    """10,000 calls alternating two inputs, then 500 replays of a graph of 2 calls; the largest
    error against the reference stays small and finite. Returns the seconds of the 10,000."""
    from megatron_tokenweave.ops.reference import fused_allreduce_rmsnorm_reference

    dtype, hidden, world = torch.bfloat16, 8192, dist.get_world_size(group)
    sets = []
    for k in range(2):
        part, res_in, w, res_out, normed, residual = _case_tensors(
            buf, layout, n, hidden, dtype, world, rank, 1000 + k, True, False)
        src = part.clone()
        ref_res = torch.empty_like(residual)
        ref_normed = torch.empty(part.shape, dtype=dtype, device=dev)
        fused_allreduce_rmsnorm_reference(src, residual, w, EPS, ref_res, ref_normed, layout, group)
        sets.append((src, residual, w, ref_res, ref_normed))
    res_out = torch.empty(n, hidden, dtype=dtype, device=dev)
    err = torch.zeros((), dtype=torch.float32, device=dev)

    def step(k):
        src, residual, w, ref_res, ref_normed = sets[k]
        part.copy_(src)
        _call(comm, (part, residual, w, EPS, res_out, normed, layout), 8, copy_engine, phased,
              validate=False)
        err.copy_(torch.maximum(err, (normed.float() - ref_normed.float()).abs().max()))
        err.copy_(torch.maximum(err, (res_out.float() - ref_res.float()).abs().max()))

    what = f"rank {rank} {layout.value} n={n} copy_engine={copy_engine} phased={phased}"
    t1 = time.time()
    for i in range(10000):
        step(i % 2)
    torch.cuda.synchronize()
    t_loop = time.time() - t1
    assert err.item() < 0.1 and err.isfinite().item(), f"{what}: 10k-call max err {err}"
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(0)
        step(1)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        step(0)
        step(1)
    err.zero_()
    for _ in range(500):  # 2 ops per replay -> 1,000 op replays
        graph.replay()
    torch.cuda.synchronize()
    assert err.item() < 0.1 and err.isfinite().item(), f"{what}: graph max err {err}"
    buf.check_error()
    del graph
    return t_loop


def _phased_in_flight(buf, comm, group, rank, dev) -> None:
    """The layer's arrangement: the transfers of two halves queued on the side stream before
    either reduction, the reductions on the main stream afterwards (128 CTAs). Then, for each
    rank in turn, the OTHER rank poisons its own partial rows after its transfers and
    reductions finished, before this rank reduces: the reduction reads only the local mirror."""
    from megatron_tokenweave.ops.reference import fused_allreduce_rmsnorm_reference
    from megatron_tokenweave.ops.validate import Layout

    dtype, hidden, layout = torch.bfloat16, 8192, Layout.REPLICATED
    main, side = torch.cuda.current_stream(), _side_stream()
    rows = (1000, 1031)
    for late in range(dist.get_world_size(group)):
        halves, offset = [], 0
        for k, n in enumerate(rows):
            part = buf.view(dtype, (1, n, hidden), offset)
            offset += (n * hidden * 2 + 255) // 256 * 256
            part.copy_(_gen(7000 + 16 * k + rank, (1, n, hidden), dtype, dev))
            residual = _gen(7008 + 16 * k, (n, hidden), dtype, dev)
            w = (1.0 + 0.1 * _gen(7015 + 16 * k, (hidden,), dtype, dev)).to(dtype)
            ref_res, ref_normed = torch.empty_like(residual), torch.empty(1, n, hidden,
                                                                           dtype=dtype, device=dev)
            fused_allreduce_rmsnorm_reference(part.clone(), residual, w, EPS, ref_res, ref_normed,
                                              layout, group)
            res_out = torch.full_like(residual, float("nan"))
            normed = torch.full((1, n, hidden), float("nan"), dtype=dtype, device=dev)
            halves.append(((part, residual, w, EPS, res_out, normed, layout), ref_res, ref_normed))
        side.wait_stream(main)
        with torch.cuda.stream(side):
            for args, _, _ in halves:
                comm.run(*args, ctas=128, path="copy_engine", phase="transfer")
        main.wait_stream(side)

        def reduce_all(halves=halves):
            for args, _, _ in halves:
                comm.run(*args, ctas=128, path="copy_engine", phase="reduce")

        if rank != late:
            reduce_all()
            for (part, *_), _, _ in halves:
                part.fill_(float("nan"))  # the late rank has pulled these rows already
        torch.cuda.synchronize()
        dist.barrier(group)
        if rank == late:
            reduce_all()
        torch.cuda.synchronize()
        for k, (args, ref_res, ref_normed) in enumerate(halves):
            what = f"rank {rank} late={late} half {k} (phased, in flight)"
            torch.testing.assert_close(args[4], ref_res, **_tol(dtype), msg=what)
            torch.testing.assert_close(args[5], ref_normed, **_tol(dtype), msg=what)
        dist.barrier(group)
    buf.check_error()


def _timeout_check(group, rank, dev) -> None:
    """Every rank but the last calls, the last does not: the callers' kernels give up, write NaN
    into their output (not the stale rows it held) and check_error names the missing rank, on
    the barrier path (sequence parallel), the one-shot path (replicated, few rows) and the
    copy-engine path; a later call writes NaN at once (the error is sticky)."""
    from megatron_tokenweave import kernels
    from megatron_tokenweave.ops.validate import Layout

    world = dist.get_world_size(group)
    missing = world - 1
    for layout, where, ce in ((Layout.SEQUENCE_PARALLEL, "START barrier", False),
                              (Layout.REPLICATED, "one-shot exchange", False),
                              (Layout.REPLICATED, "START barrier", True)):
        buf = kernels.SymmetricBuffer(group, 1 << 20, dev, timeout_s=0.2)
        comm = kernels.KernelComm(buf)
        if ce:
            comm.attach_mirror(kernels.CopyEngineMirror(buf, buf.nbytes))
        n, hidden, dtype = 4, 1024, torch.bfloat16
        chunks = world if layout is Layout.SEQUENCE_PARALLEL else 1
        part = buf.view(dtype, (chunks, n, hidden), 0)
        part.normal_()
        residual = torch.randn(n, hidden, dtype=dtype, device=dev)
        path = "copy_engine" if ce else "sm"
        if rank != missing:
            for _ in range(2):
                out = residual.clone()  # finite rows: what a silent failure would leave
                comm.run(part, residual, None, EPS, out, None, layout, ctas=2, path=path)
                torch.cuda.synchronize()
                assert out.isnan().all(), f"{layout.value} ce={ce}: outputs not poisoned"
                with pytest.raises(RuntimeError, match=f"peer rank {missing} never arrived at "
                                   f"the {where} .*timeout 0.2 s"):
                    buf.check_error()
        else:
            buf.check_error()  # nothing recorded here
        comm.close()
        buf.close()


def _failure_surfaces_under_graphs(group, rank, dev) -> None:
    """The serving arrangement: the op and the communicator's error copy captured in one CUDA
    graph, replayed in step by both ranks; then rank 1 skips one replay. Rank 0's replay gives
    up, its outputs are NaN (not the previous replay's rows), and raise_if_failed (no sync,
    reading the words the graph copied) raises naming the peer, the slot and the timeout; the
    next replay writes NaN at once. Each data path: one-shot, barrier (pull-all below TP 4,
    two-shot from TP 4), copy engine. With more ranks, the last one skips and every other rank
    checks."""
    from megatron_tokenweave.bench.timing import capture_graph
    from megatron_tokenweave.communicator import Communicator
    from megatron_tokenweave.ops.validate import Layout

    os.environ["TOKENWEAVE_KERNEL_TIMEOUT_S"] = "2"
    hidden, dtype = 4096, torch.bfloat16
    for rows, kind, where in ((8, "fused", "one-shot exchange"), (1100, "fused", "START barrier"),
                              (8, "copy_engine", "START barrier")):
        comm = Communicator(group, 2048, hidden, dtype, dev, "kernel")
        comm.prepare_copy_engine()
        part = comm.partial[:rows].view(1, rows, hidden)
        src = _gen(900 + rank, (1, rows, hidden), dtype, dev)
        residual = _gen(950, (rows, hidden), dtype, dev)
        w = (1.0 + 0.1 * _gen(951, (hidden,), dtype, dev)).to(dtype)
        res_out = torch.empty(rows, hidden, dtype=dtype, device=dev)
        normed = torch.empty(1, rows, hidden, dtype=dtype, device=dev)

        def step(part=part, src=src, residual=residual, w=w, res_out=res_out, normed=normed,
                 comm=comm, kind=kind):
            part.copy_(src)
            comm.allreduce_rmsnorm(part, residual, w, EPS, res_out, normed, Layout.REPLICATED,
                                   ctas=4, comm=kind)
            comm.record_errors()

        graph = capture_graph(step)
        what = f"rank {rank} rows={rows} comm={kind}"
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            comm.raise_if_failed()
            assert res_out.isfinite().all() and normed.isfinite().all(), what
        dist.barrier(group)
        missing = dist.get_world_size(group) - 1
        if rank != missing:
            graph.replay()  # the missing rank skips this one
            torch.cuda.synchronize()
            assert res_out.isnan().all() and normed.isnan().all(), f"{what}: stale rows"
            with pytest.raises(RuntimeError, match=f"peer rank {missing} never arrived at the "
                               f"{where} "
                               r"\(.*timeout 2.0 s\)"):
                comm.raise_if_failed()
            res_out.zero_()
            graph.replay()  # sticky: NaN at once
            torch.cuda.synchronize()
            assert res_out.isnan().all(), f"{what}: a later replay left rows unwritten"
        dist.barrier(group)
        del graph
        comm.destroy()
    os.environ.pop("TOKENWEAVE_KERNEL_TIMEOUT_S")


# The one-GPU check's data paths: every SETTINGS entry on the SM-driven kernels, and the
# copy-engine op whole and as a transfer + a reduction (where phases apply; else whole).
PATHS_ONE_GPU = (*SETTINGS, "copy_engine", "phased")
# Token counts (odd ones, fewer rows than ranks, past the one-shot buffer), each with a hidden
# size: every count and every hidden size of the protocol check, and Qwen2.5-7B's 3584 (its CTA
# rounded up to whole warps per team: a warp without columns).
CASES_ONE_GPU = ((1, 4096), (3, 5120), (7, 8192), (127, 4096), (1000, 5120), (2049, 8192),
                 (1031, 3584))
LOOP_CALLS = 10000


def _misaligned_raise(comm) -> None:
    """Without the Python checks (validate=False: a layer's forwards after its first), a tensor
    that is not 16-byte aligned still raises from the op's own checks, before anything is
    launched (both ranks pass the same tensors and raise alike: no rank waits for another), on
    the SM-driven and the copy-engine path."""
    from megatron_tokenweave.ops.validate import Layout

    n, hidden, dtype, dev = 8, 4096, torch.bfloat16, comm.buffer.device
    part = comm.buffer.view(dtype, (1, n, hidden), 0)
    aligned = torch.randn(n, hidden, dtype=dtype, device=dev)
    shifted = torch.empty(n * hidden + 8, dtype=dtype, device=dev)[1:1 + n * hidden].view(n, hidden)
    w = torch.ones(hidden + 8, dtype=dtype, device=dev)
    normed = torch.empty(1, n, hidden, dtype=dtype, device=dev)
    cases = {"residual/residual_out": (shifted, w[:hidden]), "weight": (aligned, w[1:1 + hidden])}
    for name, (res, weight) in cases.items():
        for path in ("sm", "copy_engine"):
            with pytest.raises(RuntimeError, match=f"{name} is not 16-byte aligned"):
                comm.run(part, res, weight, EPS, aligned.clone(), normed, Layout.REPLICATED,
                         ctas=4, path=path, validate=False)


def _expected(world, rank, layout, n, hidden, dtype, seed, dev):
    """(y of this rank's rows, every chunk's y) in fp32, from every rank's deterministic inputs
    (_case_tensors' seeds)."""
    from megatron_tokenweave.ops.validate import Layout

    sp = layout is Layout.SEQUENCE_PARALLEL
    chunks = world if sp else 1
    parts = [_gen(seed * 16 + p, (chunks, n, hidden), dtype, dev).float() for p in range(world)]
    res_all = [_gen(seed * 16 + 8 + (c if sp else 0), (n, hidden), dtype, dev).float()
               for c in range(chunks)]
    y_all = [sum(pp[c] for pp in parts) + res_all[c] for c in range(chunks)]
    return y_all[rank if sp else 0], y_all


def _check(res_out, normed, y, y_all, w, dtype, what) -> None:
    from megatron_tokenweave.ops.reference import rms_norm_fp32

    torch.testing.assert_close(res_out, y.to(dtype), **_tol(dtype), msg=what)
    if w is not None:
        for c, yc in enumerate(y_all):
            exp = rms_norm_fp32(yc, w, EPS).to(dtype)
            torch.testing.assert_close(normed[c], exp, **_tol(dtype), msg=what)


def _check_rounded(call: dict, w, dtype, mine: int) -> None:
    """A GEMM-fused call's outputs within the GEMM's rounding (`_rounding.within`): residual_out
    against this rank's rows, every chunk's normed rows against RMSNorm of the exact sum."""
    from megatron_tokenweave.ops.reference import rms_norm_fp32

    within(call["out"].float(), call["y"], call["slack"][mine], "residual_out")
    for c, (yc, slack) in enumerate(zip(call["y_all"], call["slack"], strict=True)):
        rstd = torch.rsqrt(yc.pow(2).mean(-1, keepdim=True) + EPS)
        want = rms_norm_fp32(yc, w, EPS)
        within(call["normed"][c].float(), want,
               slack * rstd * w.float().abs() + ulp(want, dtype), f"normed chunk {c}")


def _alternating_calls(comms, buf, world, rank, dev) -> float:
    """LOOP_CALLS replicated calls alternating two token counts in two regions of the buffer
    (127 rows at offset 0, 1000 rows further on: at TP >= 4 the first is one-shot below 8 ranks'
    8 MiB, the second two-shot), a CUDA graph of a third count (7 rows, its own region) replayed
    between them every 10 calls; every output checked against its expectation at the end (max
    error accumulated on the device, no sync in the loop). Returns the loop's seconds."""
    from megatron_tokenweave.bench.timing import capture_graph
    from megatron_tokenweave.ops.reference import rms_norm_fp32
    from megatron_tokenweave.ops.validate import Layout

    dtype, hidden, layout = torch.bfloat16, 4096, Layout.REPLICATED
    region = 16 << 20  # bytes between the three cases' partial rows
    sets = []
    for k, n in enumerate((127, 1000, 7)):
        seed = 3000 + k
        part = buf.view(dtype, (1, n, hidden), k * region)
        src = _gen(seed * 16 + rank, (1, n, hidden), dtype, dev)
        residual = _gen(seed * 16 + 8, (n, hidden), dtype, dev)
        w = (1.0 + 0.1 * _gen(seed * 16 + 15, (hidden,), dtype, dev)).to(dtype)
        y, y_all = _expected(world, rank, layout, n, hidden, dtype, seed, dev)
        res_out = torch.empty(n, hidden, dtype=dtype, device=dev)
        normed = torch.empty(1, n, hidden, dtype=dtype, device=dev)
        want = (y.to(dtype).float(), rms_norm_fp32(y_all[0], w, EPS).to(dtype).float())
        sets.append((part, src, residual, w, res_out, normed, want))
    err = torch.zeros((), dtype=torch.float32, device=dev)
    comm = comms["default"]

    def step(k):
        part, src, residual, w, res_out, normed, want = sets[k]
        part.copy_(src)  # the two-shot path leaves y in the partial rows
        res_out.fill_(float("nan"))
        normed.fill_(float("nan"))
        comm.run(part, residual, w, EPS, res_out, normed, layout, ctas=8, validate=False)
        err.copy_(torch.maximum(err, (res_out.float() - want[0]).abs().max()))
        err.copy_(torch.maximum(err, (normed[0].float() - want[1]).abs().max()))

    graph = capture_graph(lambda: step(2))
    err.zero_()
    t0 = time.time()
    for i in range(LOOP_CALLS):
        step(i % 2)
        if i % 10 == 9:
            graph.replay()
    torch.cuda.synchronize()
    assert err.isfinite().item() and err.item() < 0.1, f"rank {rank}: loop max err {err}"
    del graph
    return time.time() - t0


def _worker_one_gpu(rank: int, world: int, port: int) -> None:
    """`world` processes on GPU 0 (gloo + CUDA IPC): protocol check against local expectations,
    on every data path (PATHS_ONE_GPU), both layouts, CASES_ONE_GPU, with and without a norm,
    bf16 and fp16, outputs poisoned before every call; LOOP_CALLS alternating calls with graph
    replays between them; misaligned input; the timeout path, eagerly and under graph replay."""
    from megatron_tokenweave import kernels
    from megatron_tokenweave.ops.validate import Layout, phases_apply

    group = _init(rank, world, port, "gloo", 0)
    dev = torch.device("cuda", 0)
    buf = kernels.SymmetricBuffer(group, 96 << 20, dev, timeout_s=30)
    mirror = kernels.CopyEngineMirror(buf, buf.nbytes)
    comms = _comms(kernels, buf, mirror)
    seed, nphased, t0 = 500, 0, time.time()
    paths_taken = set()
    for layout in (Layout.SEQUENCE_PARALLEL, Layout.REPLICATED):
        for tokens, hidden in CASES_ONE_GPU:
            for weight_on in (True, False):
                for path, dtype in itertools.product(PATHS_ONE_GPU,
                                                     (torch.bfloat16, torch.float16)):
                    seed += 1
                    n = _rows(tokens, world, layout is Layout.SEQUENCE_PARALLEL)
                    part, res_in, w, res_out, normed, residual = _case_tensors(
                        buf, layout, n, hidden, dtype, world, rank, seed, weight_on, False)
                    y, y_all = _expected(world, rank, layout, n, hidden, dtype, seed, dev)
                    ce = path in ("copy_engine", "phased")
                    phased = path == "phased" and phases_apply(layout, w)
                    comm = comms["default" if ce else path]
                    oneshot = comm.settings.oneshot and kernels.oneshot_applies(
                        layout, world, n, hidden, 2)
                    if (not ce and layout is Layout.REPLICATED and comm.settings.twoshot
                            and world >= kernels.TWOSHOT_MIN_WORLD and not oneshot):
                        paths_taken.add("twoshot")
                    _call(comm, (part, res_in, w, EPS, res_out, normed, layout), 4, ce, phased)
                    _check(res_out, normed, y, y_all, w, dtype,
                           f"{world}-rank 1-GPU rank {rank} {dtype} {layout.value} "
                           f"tokens={tokens} H={hidden} w={weight_on} path={path} "
                           f"phased={phased}")
                    nphased += phased
    assert nphased >= 8, nphased
    assert world < kernels.TWOSHOT_MIN_WORLD or "twoshot" in paths_taken
    t_cases = time.time() - t0
    _progress(rank, world, f"protocol cases {t_cases:.1f} s")
    t_loop = _alternating_calls(comms, buf, world, rank, dev)
    _progress(rank, world, f"{LOOP_CALLS} alternating calls {t_loop:.1f} s")
    _misaligned_raise(comms["default"])
    buf.check_error()
    for comm in comms.values():
        comm.close()
    buf.close()
    _timeout_check(group, rank, dev)
    _failure_surfaces_under_graphs(group, rank, dev)
    _progress(rank, world, "timeouts eager and under graphs")
    _divergence(group, rank, dev)
    print(f"[rank {rank}/{world}] one-GPU protocol OK: cases {t_cases:.1f}s, {LOOP_CALLS} "
          f"calls {t_loop:.1f}s", flush=True)
    dist.destroy_process_group()


def test_kernel_two_gpus():
    if _gpus() < 2:
        pytest.skip("needs 2 GPUs (NCCL refuses two ranks on one GPU)")
    _kernels_or_skip()
    mp.spawn(_worker_two_gpus, args=(2, free_port()), nprocs=2, join=True)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_kernel_protocol_one_gpu(world):
    """TP 2, 4 and 8 as processes sharing GPU 0: functional only (time-sliced ranks), never a
    performance figure."""
    _kernels_or_skip()
    mp.spawn(_worker_one_gpu, args=(world, free_port()), nprocs=world, join=True)


# A rank that misses one call (divergence): per data path, (name, layout, rows of a chunk, comm,
# whether a peer on the other call is seen at once; the GEMM-fused consumer may time out first).
DIVERGENCE_PATHS = (("one-shot", "replicated", 8, "fused", True),
                    ("barrier / two-shot", "replicated", 1100, "fused", True),
                    ("sequence parallel", "sequence_parallel", 64, "fused", True),
                    ("copy engine", "replicated", 8, "copy_engine", True),
                    ("GEMM-fused", "replicated", 300, "gemm", False),
                    ("GEMM-fused, sequence parallel", "sequence_parallel", 64, "gemm", False))
DIVERGENCE_CALLS, SKIPPED, SITES = 8, 2, 4  # calls i, the one the last rank misses, call numbers


def _progress(rank: int, world: int, what: str) -> None:
    """Rank 0 says what passed (a long one-GPU job shows where it is)."""
    if rank == 0:
        print(f"[{world} ranks, {time.strftime('%X')}] passed: {what}", flush=True)


def _divergence(group, rank, dev) -> None:
    """The last rank misses call SKIPPED of a sequence whose calls are numbered as a layer's
    (i % SITES); every rank goes on calling. Every output of every call on every rank is then
    correct or NaN, never wrong-but-finite, and every rank raises (a peer on another call, or
    a timeout where a GEMM-fused consumer waits first); each path eagerly, and under CUDA-graph
    replay (each rank's graph holds its own sequence: the last rank's lacks the call)."""
    os.environ["TOKENWEAVE_KERNEL_TIMEOUT_S"] = "2"
    for case, graphed in itertools.product(DIVERGENCE_PATHS, (False, True)):
        _divergence_case(group, rank, dev, *case, graphed)
        _progress(rank, dist.get_world_size(group), f"divergence: {case[0]}, graphed={graphed}")
    _divergence_of_shape(group, rank, dev)
    _progress(rank, dist.get_world_size(group), "divergence: one-shot, a call of another shape")
    os.environ.pop("TOKENWEAVE_KERNEL_TIMEOUT_S")


def _divergence_of_shape(group, rank, dev) -> None:
    """One-shot path: the last rank makes call SKIPPED with fewer rows than its peers (another
    call by shape: its tag differs and some rows its peers poll never come). Every rank stops
    at once on the peer's tag (the CTA's polls abort: well inside the 2 s timeout), writes NaN,
    and raises naming a peer on another call; the next call is NaN at once (sticky). Runs
    inside _divergence's 2 s kernel timeout."""
    from megatron_tokenweave.communicator import Communicator, KernelFailure
    from megatron_tokenweave.ops.validate import Layout

    world, hidden, dtype, n, fewer = dist.get_world_size(group), 2048, torch.bfloat16, 8, 5
    missing = world - 1
    comm = Communicator(group, 4 * n + 8, hidden, dtype, dev, "kernel")
    w = (1.0 + 0.1 * _gen(41, (hidden,), dtype, dev)).to(dtype)

    def call(i: int, rows: int) -> torch.Tensor:
        part = comm.partial[:rows].view(1, rows, hidden)
        part.copy_(_gen(7500 + 10 * i + rank, (1, rows, hidden), dtype, dev))
        out = torch.empty(rows, hidden, dtype=dtype, device=dev)
        normed = torch.empty(1, rows, hidden, dtype=dtype, device=dev)
        comm.allreduce_rmsnorm(part, _gen(7600 + i, (rows, hidden), dtype, dev), w, EPS, out,
                               normed, Layout.REPLICATED, ctas=4, comm="fused", call=i % SITES)
        return torch.cat([out.flatten(), normed.flatten()])

    for i in range(SKIPPED):  # in step (and compiled, the buffers made)
        assert call(i, n).isfinite().all()
    torch.cuda.synchronize()
    comm.raise_if_failed()
    dist.barrier(group)
    t0 = time.monotonic()
    other = call(SKIPPED, fewer if rank == missing else n)
    after = call(SKIPPED + 1, n)
    comm.record_errors()
    torch.cuda.synchronize()
    took = time.monotonic() - t0
    what = f"rank {rank}/{world}: {took:.2f} s"
    assert other.isnan().all() and after.isnan().all(), what
    assert took < 1.0, f"{what}: waited for the timeout, not stopped on the peer's tag"
    with pytest.raises(KernelFailure, match="is on another call"):
        comm.raise_if_failed()
    dist.barrier(group)
    comm.destroy()


def _divergence_case(group, rank, dev, name: str, layout_name: str, n: int, kind: str,
                     at_once: bool, graphed: bool) -> None:
    from megatron_tokenweave.communicator import Communicator, KernelFailure
    from megatron_tokenweave.ops.segments import half_segments
    from megatron_tokenweave.ops.validate import Layout
    from megatron_tokenweave.schedule import Half

    world, hidden, k, dtype = dist.get_world_size(group), 2048, 512, torch.bfloat16
    missing = world - 1
    layout = Layout(layout_name)
    sp = layout is Layout.SEQUENCE_PARALLEL
    chunks = world if sp else 1
    comm = Communicator(group, DIVERGENCE_CALLS * chunks * n + 8, hidden, dtype, dev, "kernel")
    if kind == "copy_engine":
        comm.prepare_copy_engine()
    if kind == "gemm":
        comm.prepare_gemm()
    w = (1.0 + 0.1 * _gen(40, (hidden,), dtype, dev)).to(dtype)

    def src(q: int, i: int):
        """Rank q's partial of call i, or for comm="gemm" the GEMM's input and weight."""
        if kind != "gemm":
            return _gen(7000 + 100 * i + q, (chunks, n, hidden), dtype, dev)
        return (_gen(9000 + 100 * i + q, (chunks * n, k), dtype, dev),
                _gen(9500 + q, (hidden, k), dtype, dev) / k ** 0.5)

    calls = []
    for i in range(DIVERGENCE_CALLS):
        residuals = [_gen(8000 + 10 * i + c, (n, hidden), dtype, dev) for c in range(chunks)]
        parts = [(s[0].float() @ s[1].float().t()).to(dtype).view(chunks, n, hidden)
                 if kind == "gemm" else s for s in (src(q, i) for q in range(world))]
        y_all = [sum(p[c].float() for p in parts) + residuals[c].float() for c in range(chunks)]
        # The GEMM's partial sums may round to the neighbours of torch's (_rounding.py)
        slack = [sum(ulp(p[c].float(), dtype) for p in parts) + ulp(y_all[c], dtype)
                 for c in range(chunks)] if kind == "gemm" else None
        normed = (comm.normed[i * chunks * n:(i + 1) * chunks * n].view(chunks, n, hidden)
                  if sp else torch.empty(1, n, hidden, dtype=dtype, device=dev))
        calls.append(dict(src=src(rank, i), residual=residuals[rank if sp else 0],
                          out=torch.empty(n, hidden, dtype=dtype, device=dev), normed=normed,
                          y=y_all[rank if sp else 0], y_all=y_all, slack=slack))
    part = comm.partial[:chunks * n].view(chunks, n, hidden)
    halves = (Half(0, n),)

    def issue(i: int) -> None:
        c = calls[i]
        op = dict(ctas=4, comm=kind, call=i % SITES)
        if kind == "gemm":
            seg = half_segments(layout, world, halves, 0, hidden=hidden, k=k, ctas=8,
                                chunk_stride=n)
            x, wq = c["src"]
            comm.row_gemm(x, wq, None, seg, 0, ctas=8, call=i % SITES)
            op.update(segments=seg, set_index=0)
        else:
            part.copy_(c["src"])
        comm.allreduce_rmsnorm(part, c["residual"], w, EPS, c["out"], c["normed"], layout, **op)

    def run(skip: bool) -> None:
        for i in range(DIVERGENCE_CALLS):
            if not (skip and rank == missing and i == SKIPPED):
                issue(i)
        comm.record_errors()

    def verdicts() -> list[str]:
        """Per call: "ok" (within bf16 rounding of the expectation) or "nan" (every row
        poisoned); anything else names a wrong-but-finite call."""
        torch.cuda.synchronize()
        out = []
        for i, c in enumerate(calls):
            if all(t.isnan().all() for t in (c["out"], *c["normed"])):
                out.append("nan")
                continue
            try:
                if c["slack"] is None:
                    _check(c["out"], c["normed"], c["y"], c["y_all"], w, dtype, "")
                else:
                    _check_rounded(c, w, dtype, rank if sp else 0)
                out.append("ok")
            except AssertionError as exc:
                out.append(f"WRONG call {i}: {str(exc).splitlines()[0][:160]}")
        return out

    what = f"{name} graphed={graphed} rank {rank}/{world}"
    run(False)  # in step: every call right (and the kernels compiled, the buffers made)
    healthy = verdicts()
    assert healthy == ["ok"] * DIVERGENCE_CALLS, (what, healthy, comm.symmetric.error())
    comm.raise_if_failed()
    dist.barrier(group)
    for c in calls:  # poison: an unwritten output must not read as right
        c["out"].fill_(float("nan"))
        c["normed"].fill_(float("nan"))
    graph = None
    if graphed:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run(True)
        for _ in range(2):
            graph.replay()
            seen = verdicts()
            assert not [v for v in seen if v.startswith("WRONG")], (what, seen)
    else:
        run(True)
        seen = verdicts()
    assert not [v for v in seen if v.startswith("WRONG")], (what, seen)
    assert "nan" in seen, (what, seen)
    pattern = "is on another call" if at_once else "is on another call|never arrived"
    with pytest.raises(KernelFailure, match=pattern):
        comm.raise_if_failed()
    dist.barrier(group)
    del graph
    comm.destroy()
