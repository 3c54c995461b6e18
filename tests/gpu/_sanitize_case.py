"""A small 2-rank run of the fused kernel for compute-sanitizer (memcheck, racecheck): the
barrier path in both layouts (bulk copies; registers once), the one-shot path (small replicated
call) and the copy-engine path in both layouts, whole and (replicated) as a transfer + a
reduction; then the GEMM-fused path (the communicating GEMM + its consumer) in both layouts with
both releases. With one GPU both ranks share it (two processes, CUDA IPC).

Ranks talk over gloo (no NCCL under the sanitizer), map each other's buffers by CUDA IPC and
check the kernel against an fp32 computation of the gathered inputs. Exit code 0: all correct.
Launched by tests/gpu/test_sanitizer.py as `compute-sanitizer ... python _sanitize_case.py`.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


def _worker(rank: int, world: int, port: int) -> None:
    from megatron_tokenweave import kernels
    from megatron_tokenweave.launch import NO_MULTICAST_ENV
    from megatron_tokenweave.ops.reference import rms_norm_fp32
    from megatron_tokenweave.ops.validate import Layout

    os.environ.update(NO_MULTICAST_ENV)
    device = rank % torch.cuda.device_count()
    torch.cuda.set_device(device)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    n, hidden, dtype, eps = 37, 1024, torch.bfloat16, 1e-5
    buf = kernels.SymmetricBuffer(dist.group.WORLD, 4 << 20, device, timeout_s=300)
    mirror = kernels.CopyEngineMirror(buf, 1 << 20)
    comms = {}
    for bulk in (True, False):
        for oneshot in (True, False):
            comms[bulk, oneshot] = kernels.KernelComm(
                buf, kernels.KernelSettings(bulk=bulk, oneshot=oneshot))
            comms[bulk, oneshot].attach_mirror(mirror)
    gen = torch.Generator().manual_seed(7)
    # The replicated case on the one-shot path (default at this size), the barrier path and its
    # register variant; both layouts on the copy-engine path, replicated also in two phases.
    for layout, no_oneshot, no_bulk, ce, phased in (
            (Layout.SEQUENCE_PARALLEL, False, False, False, False),
            (Layout.REPLICATED, False, False, False, False),
            (Layout.REPLICATED, True, False, False, False),
            (Layout.REPLICATED, True, True, False, False),
            (Layout.SEQUENCE_PARALLEL, False, False, True, False),
            (Layout.REPLICATED, False, False, True, False),
            (Layout.REPLICATED, False, False, True, True)):
        comm = comms[not no_bulk, not no_oneshot]
        chunks = world if layout is Layout.SEQUENCE_PARALLEL else 1
        parts = [torch.randn(chunks, n, hidden, generator=gen).to(dtype) for _ in range(world)]
        res_all = [torch.randn(n, hidden, generator=gen).to(dtype) for _ in range(world)]
        weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
        partial = buf.view(dtype, (chunks, n, hidden), 0)
        partial.copy_(parts[rank])
        residual = (res_all[rank] if chunks > 1 else res_all[0]).cuda()
        normed = buf.view(dtype, (chunks, n, hidden), 1 << 20) if chunks > 1 else \
            torch.empty(1, n, hidden, dtype=dtype, device="cuda")
        normed.fill_(float("nan"))
        out = torch.full_like(residual, float("nan"))
        dist.barrier()
        args = (partial, residual, weight.cuda(), eps, out, normed, layout)
        for phase in (("transfer", "reduce") if phased else ("whole",)):
            comm.run(*args, ctas=4, path="copy_engine" if ce else "sm", phase=phase)
        torch.cuda.synchronize()
        dist.barrier()
        mine = rank if chunks > 1 else 0
        y = sum(p[mine].float() for p in parts) + residual.cpu().float()
        want_normed = [
            rms_norm_fp32(sum(p[c].float() for p in parts)
                          + (res_all[c] if chunks > 1 else res_all[0]).float(), weight, eps)
            for c in range(chunks)
        ]
        err_y = (out.cpu().float() - y).abs().max().item()
        err_n = max((normed[c].cpu().float() - want_normed[c]).abs().max().item()
                    for c in range(chunks))
        if not (err_y < 0.1 and err_n < 0.1):
            raise SystemExit(f"rank {rank} {layout.value} no_oneshot={no_oneshot} "
                             f"no_bulk={no_bulk} copy_engine={ce} "
                             f"phased={phased}: errors "
                             f"{err_y} {err_n}")
    for comm in comms.values():
        comm.close()
    buf.close()
    _gemm_fused(rank, world, device, gen)
    dist.destroy_process_group()


def _gemm_fused(rank: int, world: int, device: int, gen: torch.Generator) -> None:
    """The GEMM-fused path: every rank's GEMM stores its tiles into the owners' inboxes, the
    owners reduce + add + norm; both layouts, both releases (ops/segments.RELEASES)."""
    from megatron_tokenweave.communicator import Communicator
    from megatron_tokenweave.ops.reference import rms_norm_fp32
    from megatron_tokenweave.ops.segments import RELEASES, segments
    from megatron_tokenweave.ops.validate import Layout

    n, k, hidden, dtype, eps = 37, 256, 1024, torch.bfloat16, 1e-5
    dev = torch.device("cuda", device)
    comm = Communicator(dist.group.WORLD, world * n, hidden, dtype, dev, "kernel")
    comm.prepare_gemm()
    for layout in (Layout.SEQUENCE_PARALLEL, Layout.REPLICATED):
        for release in RELEASES:
            chunks = world if layout is Layout.SEQUENCE_PARALLEL else 1
            xs = [torch.randn(chunks * n, k, generator=gen).to(dtype) for _ in range(world)]
            ws = [(torch.randn(hidden, k, generator=gen) / k**0.5).to(dtype) for _ in range(world)]
            res_all = torch.randn(chunks, n, hidden, generator=gen).to(dtype)
            weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
            mine = rank if chunks > 1 else 0
            residual = res_all[mine].to(dev)
            out = torch.full_like(residual, float("nan"))
            normed = comm.normed[:chunks * n].view(chunks, n, hidden)
            normed.fill_(float("nan"))
            seg = segments(layout, world, n, hidden=hidden, k=k, ctas=8, chunk_stride=n,
                           release=release)
            dist.barrier()
            comm.row_gemm(xs[rank].to(dev), ws[rank].to(dev), None, seg, 0, ctas=8)
            part = comm.partial[:chunks * n].view(chunks, n, hidden)
            comm.allreduce_rmsnorm(part, residual, weight.to(dev), eps, out, normed, layout,
                                   comm="gemm", segments=seg, set_index=0, ctas=4)
            torch.cuda.synchronize()
            dist.barrier()
            y = sum((x.float() @ w.float().t()).to(dtype).float()
                    for x, w in zip(xs, ws, strict=True))
            y = y.view(chunks, n, hidden) + res_all.float()
            err_y = (out.cpu().float() - y[mine]).abs().max().item()
            err_n = max((normed[c].cpu().float() - rms_norm_fp32(y[c], weight, eps)).abs().max()
                        .item() for c in range(chunks))
            if not (err_y < 0.1 and err_n < 0.1):
                raise SystemExit(f"rank {rank} GEMM-fused {layout.value} release={release}: "
                                 f"errors {err_y} {err_n}")
    comm.symmetric.check_error()
    comm.destroy()


if __name__ == "__main__":
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 29561
    mp.spawn(_worker, args=(2, port), nprocs=2, join=True)
    print("sanitize case: ok")
