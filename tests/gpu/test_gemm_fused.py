"""GPU tests of the GEMM-fused mechanism: the communicating row-parallel GEMM (its epilogue stores
each tile into the owner's inbox and flags it) and the owner's reduction + residual + RMSNorm
that waits on those flags (skip cleanly without a GPU). test_gemm_fused_two_gpus runs the same
on two GPUs (NCCL group; skipped with fewer).

test_gemm_fused_protocol_one_gpu[2, 4, 8]: that many processes sharing GPU 0 (gloo + CUDA IPC),
through the communicator (`row_gemm` + `allreduce_rmsnorm(comm="gemm")`), against an expectation
each rank computes from every rank's inputs (fp32 GEMMs rounded like the kernel's output):
- both layouts; rows per chunk (sequence parallel) or in all (replicated) that are not tile
  multiples (1, 7, 100, 300, 1000, 1031; 1, 100, 300, 1031 at TP 4 and 8); K 1024 / 3584, hidden
  4096 / 5120; bf16 and fp16; every case twice, the second time on 8 GEMM CTAs with the other
  release (the GEMM's CTAs or the consumer publish the tiles); between them every tile shape,
  both GEMM kernels and both releases of ops/segments.py (asserted);
  bias on rank 0 or none; with and without the norm; one call (inbox set 0) or a split pair
  (half A's consumer on a side stream beside half B's GEMM, sets 0 and 1);
- outputs poisoned (NaN) before every call, so a row nobody wrote shows; results within a
  rounding bound (one unit in the last place of every rank's partial sum and of the output);
- a CUDA graph of a split pair replayed between eager calls of other shapes (fresh epochs per
  replay), 60 times, checked every time;
- a peer that never issues its GEMM (nor its consumer), with either release: the others'
  consumers give up (NaN outputs) and the communicator's error names the GEMM-fused reduction,
  the peer and the row block;
- replicated calls with the norm, one half: the consumer writing FP8 rows (1 x 128 blocks, one
  known scale) bit-exact against the reference quantization of its rows in the activations'
  dtype;
- the inbox's kind of buffer (a SymmetricBuffer without header): zeroed, no error words.
Where the fitted CUDA kernel runs (sm_90), the policy gives it the calls just past a wave of the
Triton tiles among these (asserted: both of its modes), and a second graph is a call it takes.
Time-sliced ranks: functional only, never a performance figure.

test_fitted_gemm_matches_reference (one process, sm_90): the fitted kernel alone, every
owner's slot of a loopback inbox poisoned first, against fp32 GEMMs rounded once: replicated
(TP 2 and 8) and sequence parallel (TP 4), rows 1-1031, token extents 16-176 in both modes,
in-features with and without a tail past 64, out-features not a multiple of 128, bias or none,
bf16 and fp16, this rank 0 or another, within rounding (tests/_rounding.py); rows nobody should
write stay poisoned. And the launcher's refusals of bad input.

test_fp8_blocks_tokens_as_m_matches_dequantized_reference (sm_90): the fitted kernel with the
tokens as the MMA's M (e4m3 in blocks), every weight extent in both modes, against the FP8
cases' reference and bounds.
"""

from __future__ import annotations

import itertools
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _kernels import kernels_or_skip  # tests/ is on sys.path (conftest.py)
from _rounding import ulp, within

from megatron_tokenweave.launch import NO_MULTICAST_ENV, free_port

os.environ.update(NO_MULTICAST_ENV)

EPS = 1e-5
ROWS = (1, 7, 100, 300, 1000, 1031)
ROWS_WIDE = (1, 100, 300, 1031)  # at TP 4 and 8 (each rank computes every rank's partial sums)
SHAPES = ((1024, 4096), (3584, 5120))  # (K, hidden)
MAX_TOKENS = 8 * 1031 + 64
GRAPH_SHAPE = (4096, torch.bfloat16)  # the communicator whose calls are also graph-replayed


def _skip_without_kernels():
    kernels_or_skip()
    try:
        import triton  # noqa: F401
    except ImportError:
        pytest.skip("triton is not installed")


def _gen(seed: int, shape, dtype, dev) -> torch.Tensor:
    g = torch.Generator(device=dev)
    g.manual_seed(seed)
    return torch.randn(shape, generator=g, device=dev, dtype=torch.float32).to(dtype)


class Case:
    """One call (or split pair) of the mechanism on this rank, with its expectation."""

    def __init__(self, comm, layout, n, k, dtype, seed, bias_on, norm_on, split):
        from megatron_tokenweave.bench.gemm_pair import even_halves
        from megatron_tokenweave.ops.validate import Layout
        from megatron_tokenweave.schedule import SideStream

        world, rank, dev = dist.get_world_size(comm.group), dist.get_rank(comm.group), comm.device
        hidden = comm.hidden
        self.comm, self.layout, self.n, self.dtype = comm, layout, n, dtype
        self.world, self.rank = world, rank
        self.sp = layout is Layout.SEQUENCE_PARALLEL
        self.chunks = world if self.sp else 1
        rows = self.chunks * n
        xs = [_gen(seed + q, (rows, k), dtype, dev) for q in range(world)]
        ws = [(_gen(seed + 50 + q, (hidden, k), torch.float32, dev) * k ** -0.5).to(dtype)
              for q in range(world)]
        self.bias = _gen(seed + 99, (hidden,), dtype, dev) if bias_on else None
        self.x, self.w = xs[rank], ws[rank]
        self.residual_all = _gen(seed + 98, (rows, hidden), dtype, dev)  # [C * n, H]
        self.norm = (1.0 + 0.1 * _gen(seed + 97, (hidden,), torch.float32, dev)).to(dtype) \
            if norm_on else None
        y = self.residual_all.float()  # [C * n, H]
        self.slack = torch.zeros_like(y)  # what rounding may move y by (see check)
        for q in range(world):
            p = xs[q].float() @ ws[q].float().t()
            if q == 0 and self.bias is not None:
                p += self.bias.float()
            p = p.to(dtype).float()
            y += p
            self.slack += ulp(p, dtype)
        self.y = y
        self.slack += ulp(y, dtype)
        self.normed_want = None
        if norm_on:
            rstd = torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + EPS)
            self.normed_want = y * rstd * self.norm.float()
            self.normed_slack = self.slack * rstd * self.norm.float().abs() + ulp(
                self.normed_want, dtype)
        self.halves = even_halves(n, split)
        self.residual = self.residual_all.view(self.chunks, n, hidden)[rank if self.sp else 0]
        self.residual_out = torch.empty(n, hidden, dtype=dtype, device=dev)
        self.normed = comm.normed[:rows].view(self.chunks, n, hidden)
        self.side = SideStream(dev)
        self.tiles: set = set()  # the tile shapes its GEMMs took
        self.releases: set = set()  # and who published them
        self.last_releases: set = set()  # who published the last call's

    def run(self, gemm_ctas: int | None = None, release: str | None = None,
            normed=None) -> None:
        """The layer's sequence (bench.gemm_pair.woven_linear): per half, its GEMM (on
        gemm_ctas CTAs, default the SMs left beside the consumer; `release` forced, else the
        policy's), then its consumer (on the side stream when split, beside the next half's
        GEMM), writing the normed rows into `normed` (default self.normed)."""
        from megatron_tokenweave.bench.gemm_pair import woven_linear

        if normed is None and self.norm is not None:
            normed = self.normed
        taken = woven_linear(
            self.comm, self.layout, self.x.view(self.chunks, self.n, -1), self.w,
            self.bias if self.rank == 0 else None, self.halves, self.residual, self.norm,
            self.residual_out, normed, self.side, gemm=True, ctas=gemm_ctas, release=release)
        self.tiles.update(seg.tiles for seg in taken)
        self.last_releases = {seg.release for seg in taken}
        self.releases.update(self.last_releases)

    def poison(self) -> None:
        self.residual_out.fill_(float("nan"))
        self.normed.fill_(float("nan"))

    def check(self, what: str) -> None:
        torch.cuda.synchronize()
        hidden, n, rank = self.comm.hidden, self.n, self.rank
        mine = slice(rank * n, (rank + 1) * n) if self.sp else slice(0, n)
        got = self.residual_out.float()
        assert not got.isnan().any(), f"{what}: residual_out rows left unwritten"
        within(got, self.y[mine], self.slack[mine], f"{what}: residual_out")
        if self.normed_want is not None:
            normed = self.normed.reshape(-1, hidden).float()
            assert not normed.isnan().any(), f"{what}: normed rows left unwritten"
            within(normed, self.normed_want, self.normed_slack, f"{what}: normed")

    def check_fp8_rows(self, what: str) -> None:
        """Replicated, with the norm, one half: the call run again with its consumer writing
        FP8 rows (1 x 128 blocks with power-of-two scales, and one known scale with its amax;
        poisoned first) equals, bit for bit, the reference quantization (Fp8Rows.quantize) of
        the rows a policy-picked call wrote in the activations' dtype; residual_out the same."""
        from megatron_tokenweave.ops.fp8_rows import FP8_DTYPE, Fp8Rows, scale_stride

        n, hidden, dev = self.n, self.comm.hidden, self.comm.device
        self.poison()
        self.run()
        torch.cuda.synchronize()
        want, want_res = self.normed[0].clone(), self.residual_out.clone()
        assert not want.isnan().any(), f"{what}: normed rows left unwritten"

        def poisoned(blocks: bool) -> Fp8Rows:
            data = torch.full((1, n, hidden), 0x7F, dtype=torch.uint8, device=dev)
            nan = torch.full((1,), float("nan"), device=dev)
            if blocks:
                return Fp8Rows.blockwise(data.view(FP8_DTYPE), torch.full(
                    (hidden // 128, scale_stride(n)), float("nan"), device=dev), pow2=True)
            return Fp8Rows.tensor_scaled(data.view(FP8_DTYPE), torch.tensor([2.3], device=dev),
                                         torch.tensor([0.25], device=dev), nan)

        for blocks in (True, False):
            rows, ref = poisoned(blocks), poisoned(blocks)
            ref.quantize(want)
            self.residual_out.fill_(float("nan"))
            self.run(normed=rows)
            torch.cuda.synchronize()
            case = f"{what} FP8 {'blocks' if blocks else 'tensor'}"
            assert torch.equal(self.residual_out.view(torch.int16), want_res.view(torch.int16)), \
                f"{case}: residual_out"
            bad = rows.data.view(torch.uint8) != ref.data.view(torch.uint8)
            assert not bad.any(), f"{case}: {int(bad.sum())} of {bad.numel()} FP8 bytes differ"
            got_sinv = rows.scale_inv[:, :n] if blocks else rows.scale_inv
            want_sinv = ref.scale_inv[:, :n] if blocks else ref.scale_inv
            assert torch.equal(got_sinv, want_sinv), f"{case}: scale_inv"
            assert blocks or torch.equal(rows.amax, ref.amax), f"{case}: amax"


def _cases(comm, seed0: int):
    seed = seed0
    from megatron_tokenweave.ops.validate import Layout

    world = dist.get_world_size(comm.group)
    for layout, n, (k, hidden), dtype, split in itertools.product(
            (Layout.SEQUENCE_PARALLEL, Layout.REPLICATED), ROWS, SHAPES,
            (torch.bfloat16, torch.float16), (False, True)):
        if hidden != comm.hidden or dtype != comm.dtype or (world > 2 and n not in ROWS_WIDE):
            continue
        seed += 10
        yield Case(comm, layout, n, k, dtype, seed, bias_on=seed % 20 == 0,
                   norm_on=seed % 30 != 0, split=split)


def _graph_replays(comm, others, rank) -> int:
    """A split pair (777 rows, Triton tiles) and, where the fitted kernel runs, one call it
    takes (1031 rows), each captured once and replayed between eager calls of other cases."""
    from megatron_tokenweave.bench.timing import capture_graph
    from megatron_tokenweave.ops.validate import Layout

    replays = 0
    graphed = [(777, True)] + ([(1031, False)] if comm.fitted_gemm else [])
    for n, split in graphed:
        case = Case(comm, Layout.REPLICATED, n, 1024, comm.dtype, 4242, True, True, split)
        case.run()  # eager warm-up: Triton compiles outside the capture
        assert any(t.fitted for t in case.tiles) == (n == 1031), case.tiles
        graph = capture_graph(case.run)
        for i in range(60):
            case.poison()
            graph.replay()
            case.check(f"rank {rank} graph replay {i} ({n} rows)")
            other = others[i % len(others)]
            other.poison()
            other.run()
            other.check(f"rank {rank} eager between replays {i}")
            replays += 1
    return replays


def _peer_never_arrives(group, rank, world, dev, release: str) -> None:
    """The last rank never issues its GEMM or consumer: every other rank's consumer gives up,
    its outputs are NaN and the error names the GEMM-fused reduction and the missing peer."""
    from megatron_tokenweave.communicator import Communicator
    from megatron_tokenweave.ops.validate import Layout

    os.environ["TOKENWEAVE_KERNEL_TIMEOUT_S"] = "2"
    comm = Communicator(group, 2048, 4096, torch.bfloat16, dev, "kernel")
    comm.prepare_gemm()
    missing = world - 1
    case = Case(comm, Layout.SEQUENCE_PARALLEL, 256, 1024, torch.bfloat16, 77, False, True,
                False)
    if rank != missing:
        case.poison()
        case.run(release=release)
        torch.cuda.synchronize()
        assert case.residual_out.isnan().all(), f"{release}: outputs not poisoned after timeout"
        with pytest.raises(RuntimeError, match=f"peer rank {missing} never arrived at the "
                           "GEMM-fused reduction .*row block 0"):
            comm.symmetric.check_error()
    dist.barrier(group=group)
    comm.destroy()
    os.environ.pop("TOKENWEAVE_KERNEL_TIMEOUT_S")


def _headerless_buffer(group, dev) -> None:
    """The inbox's kind of buffer (header=False): data only, zeroed, mapped on every peer, no
    error words to read."""
    from megatron_tokenweave.kernels import SymmetricBuffer

    buf = SymmetricBuffer(group, 1 << 20, dev, header=False)
    try:
        assert buf.signal is None and buf.signal_bytes == 0
        assert buf.peer_data == buf.peer_allocs
        assert not buf.local.any(), "a new buffer starts zeroed"
        with pytest.raises(RuntimeError, match="no header"):
            buf.error_words()
    finally:
        buf.close()


def _worker(rank: int, world: int, port: int, gpus: int) -> None:
    """`world` ranks on `gpus` GPUs: one GPU shared over gloo, or one GPU each over NCCL."""
    from megatron_tokenweave.communicator import Communicator, destroy_communicators

    os.environ.update(NO_MULTICAST_ENV)
    dev = torch.device("cuda", rank if gpus > 1 else 0)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if gpus > 1 else "gloo",
                            init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=dev if gpus > 1 else None)
    group = dist.group.WORLD
    from megatron_tokenweave.ops.segments import LARGE, PINGPONG, RELEASES, SMALL, WIDE

    t0, ncases, fp8_cases = time.time(), 0, 0
    graph, tiles, releases = None, set(), set()
    for (_, hidden), dtype in itertools.product(SHAPES, (torch.bfloat16, torch.float16)):
        comm = Communicator(group, MAX_TOKENS, hidden, dtype, dev, "kernel")
        comm.prepare_gemm()
        cases = list(_cases(comm, 1000 * ncases))
        for case in cases:
            # The second call: the next epoch of the same set, on 8 GEMM CTAs (where the
            # ping-pong kernel takes most calls), with the release the first did not take (the
            # policy's again where the first call's halves took both).
            release = None
            for repeat in range(2):
                case.poison()
                case.run(gemm_ctas=8 if repeat else None, release=release)
                release = next((r for r in RELEASES if r not in case.releases), None)
                case.check(f"{world}-rank rank {rank} {dtype} {case.layout.value} n={case.n} "
                           f"K={case.x.shape[1]} H={hidden} halves={len(case.halves)} "
                           f"bias={case.bias is not None} norm={case.norm is not None} "
                           f"call {repeat} release={sorted(case.last_releases)}")
            if not case.sp and case.norm is not None and len(case.halves) == 1:
                case.check_fp8_rows(f"{world}-rank rank {rank} {dtype} n={case.n} H={hidden}")
                fp8_cases += 1
            ncases += 1
        tiles.update(*(case.tiles for case in cases))
        releases.update(*(case.releases for case in cases))
        if (hidden, dtype) == GRAPH_SHAPE:
            graph = (comm, cases)
        else:  # freed now: 8 ranks' communicators and cases of every shape overfill 80 GB
            comm.destroy()
            del cases
            torch.cuda.empty_cache()
    # Where the fitted kernel runs it takes some calls the Triton LARGE tiles took (at TP 8 all
    # of them among these cases).
    triton = {LARGE, WIDE, SMALL, PINGPONG} - ({LARGE} if comm.fitted_gemm else set())
    assert triton <= tiles, f"tile shapes exercised: {tiles}"
    fitted_modes = {t.cooperative for t in tiles if t.fitted}
    assert fitted_modes == ({False, True} if comm.fitted_gemm else set()), tiles
    assert releases == set(RELEASES), f"releases exercised: {releases}"
    comm, cases = graph
    replays = _graph_replays(comm, cases[:6], rank)
    comm.symmetric.check_error()
    destroy_communicators()
    for release in RELEASES:
        _peer_never_arrives(group, rank, world, dev, release)
    _headerless_buffer(group, dev)
    assert fp8_cases > 0
    print(f"[rank {rank}/{world}] GEMM-fused protocol OK: {ncases} cases ({fp8_cases} also "
          f"writing FP8 rows), {replays} graph replays, {time.time() - t0:.1f}s", flush=True)
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4, 8])
def test_gemm_fused_protocol_one_gpu(world):
    """TP 2, 4 and 8 as processes sharing GPU 0."""
    _skip_without_kernels()
    mp.spawn(_worker, args=(world, free_port(), 1), nprocs=world, join=True)


def test_gemm_fused_two_gpus():
    """The same cases on two GPUs over NVLink (NCCL group): the stores and flags cross GPUs."""
    _skip_without_kernels()
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    mp.spawn(_worker, args=(2, free_port(), 2), nprocs=2, join=True)


# --------------------------------------------------------------------------- the fitted kernel
def _skip_without_fitted():
    _skip_without_kernels()
    from megatron_tokenweave.kernels._ext import fitted_gemm_available

    if not fitted_gemm_available(torch.device("cuda", 0)):
        pytest.skip("the fitted GEMM needs an sm_90 GPU and the extension built for it")


# (token extent, cooperative) of the fitted tiles the fitted kernel's tests force in turn.
# (144 and 168 cooperative: the epilogue's 16-row passes, two buffers and one buffer with a
# partial last pass; 200 cooperative: consumers of 64 weight rows, a partial last pass)
FITTED_SHAPES = ((16, False), (72, True), (136, False), (144, True), (168, True), (176, True),
                 (200, True))
# in blocks up to 104 tokens consumers of 128 weight rows, past it of 64 (to 208)
FITTED_BLOCK_SHAPES = ((16, True), (40, False), (72, True), (104, False), (112, True),
                       (168, False), (208, True))
# with the tokens as M (fit_tiles(tokens_m=True)): (weight extent, cooperative), every extent of
# ops/segments.FIT_TOKENS_M_EXTENTS in both modes
TOKENS_M_SHAPES = ((64, True), (96, False), (128, True), (144, False), (160, True), (176, False),
                   (192, True), (208, False), (64, False), (96, True), (128, False), (144, True),
                   (160, False), (176, True), (192, False), (208, True))


def _padded(t: torch.Tensor, pad: int) -> torch.Tensor:
    """t's values in rows `pad` elements longer than t's, the padding NaN (a kernel that read
    past K would show it): the operand form of padded rows (a row pitch over K)."""
    if not pad:
        return t
    buf = torch.full((t.shape[0], t.shape[1] + pad), float("nan"), device=t.device).to(t.dtype)
    buf[:, :t.shape[1]] = t
    return buf[:, :t.shape[1]]


def _fitted_case(inbox, layout, world, rank, rows, k, n, block_rows, cooperative, dtype,
                 bias_on, seed, pads=(0, 0), pair=False, ctas=132,
                 split=(0, 0)) -> str | None:
    """One call of the fitted kernel into a loopback inbox of `world` owners, as rank `rank`
    (pads: elements past K in each row of x and of the weight; pair: the cooperative mode in
    clusters of two CTAs; ctas: the persistent CTAs; split: split K's (tiles, K steps a CTA)):
    None if every owner's slot holds exactly its rows, else what is wrong."""
    from megatron_tokenweave.ops.segments import fit_tiles, segments
    from megatron_tokenweave.ops.validate import Layout

    dev = torch.device("cuda", 0)
    tiles = fit_tiles(block_rows, cooperative, pair=pair, split=split)
    sp = layout is Layout.SEQUENCE_PARALLEL
    stride = rows + 5  # chunks of x apart by more than their rows (sequence parallel)
    seg = segments(layout, world, rows, hidden=n, k=k, ctas=132, tiles=tiles, first=3,
                   chunk_stride=stride if sp else 0, chunk_row0=11 if sp else 0)
    x = _gen(seed, (3 + (world * stride if sp else rows) + 2, k), dtype, dev)
    w = (_gen(seed + 1, (n, k), torch.float32, dev) * k ** -0.5).to(dtype)
    bias = _gen(seed + 2, (n,), dtype, dev) if bias_on else None
    x, w = _padded(x, pads[0]), _padded(w, pads[1])
    for slots in inbox.owner_slots:
        slots.fill_(float("nan"))
    torch.ops.tokenweave.fit_gemm(x, w, bias, inbox.bases,
                                  seg.fitted_geometry(inbox.slots_off, rank, inbox.slot_rows,
                                                      world), ctas, [], None,
                                  inbox.split_work(0) if split[0] else [])
    torch.cuda.synchronize()
    ref = x.float() @ w.float().t()
    if bias is not None:
        ref += bias.float()
    return _slots_wrong(inbox, seg, world, rank, ref.to(dtype).float(), dtype, 1e-4)


def _slots_wrong(inbox, seg, world: int, rank: int, want_rows: torch.Tensor, dtype,
                 slack) -> str | None:
    """None if every owner's slot of `rank` holds its segment's rows of `want_rows` (the
    reference over x's rows, rounded to dtype) within one unit in the last place + `slack`
    (a number or a tensor like want_rows), every other row still poisoned; else what is
    wrong."""
    if torch.is_tensor(slack):
        slack = slack.float()
    for c in range(world):
        length = seg.length(c)
        lo = seg.first + c * seg.step
        want = want_rows[lo:lo + length]
        slot = inbox.owner_slots[c][rank].float()
        got = slot[seg.row0:seg.row0 + length]
        if got.isnan().any():
            return f"owner {c}: rows left unwritten"
        room = slack[lo:lo + length] if torch.is_tensor(slack) else slack
        miss = (got - want).abs() - ulp(want, dtype) - room  # as tests/_rounding.within
        if length and (miss > 0).any():
            return f"owner {c}: beyond rounding by up to {miss.max().item():.3g}"
        rest = torch.cat([slot[:seg.row0], slot[seg.row0 + length:]])
        if not rest.isnan().all():
            return f"owner {c}: rows outside its segment written"
        others = [q for q in range(world) if q != rank]
        if others and not inbox.owner_slots[c][others].isnan().all():
            return f"owner {c}: another rank's slot written"
    return None


def _loopback_calls(n: int, dtype, dev):
    """(layout, world, inbox, rows) of the one-process GEMM tests: replicated at TP 2 and 8,
    sequence parallel at TP 4, rows 1-1031 (odd, prime, one past a tile); each layout's
    loopback inbox of n columns, closed after its rows."""
    from megatron_tokenweave.kernels.inbox import GemmInbox
    from megatron_tokenweave.ops.validate import Layout

    for layout, world in ((Layout.REPLICATED, 2), (Layout.REPLICATED, 8),
                          (Layout.SEQUENCE_PARALLEL, 4)):
        sp = layout is Layout.SEQUENCE_PARALLEL
        inbox = GemmInbox.loopback(world, world * 1031 + 64, n, dtype, dev)
        for rows in ((1, 7, 100, 260) if sp else (1, 7, 100, 513, 777, 1031)):
            yield layout, world, inbox, rows
        inbox.close()


def test_fitted_gemm_matches_reference():
    """The fitted kernel's rows equal fp32 GEMMs rounded once, within one unit in the last
    place plus 1e-4 (its fp32 accumulation order is not torch's: a sum near a rounding boundary
    may round to the neighbouring value, and a sum near zero moves by more than its own ulp)."""
    _skip_without_fitted()
    dev = torch.device("cuda", 0)
    failures, cases, seed = [], 0, 0
    for dtype in (torch.bfloat16, torch.float16):
        for (n, k) in ((8192, 4096), (4096, 1792), (3584, 2368), (1000, 200)):
            for layout, world, inbox, rows in _loopback_calls(n, dtype, dev):
                for block_rows, cooperative in FITTED_SHAPES:
                    seed += 1
                    bad = _fitted_case(inbox, layout, world, seed % world, rows, k, n,
                                       block_rows, cooperative, dtype, seed % 2 == 0, seed)
                    cases += 1
                    if bad:
                        failures.append((dtype, n, k, layout.value, world, rows, block_rows,
                                         cooperative, bad))
    print(f"fitted GEMM: {cases - len(failures)} of {cases} cases exact")
    assert not failures, failures[:10]


def _split_cases(seg, world: int, n: int, k: int) -> list[tuple[tuple[int, int], int]]:
    """((split tiles, K steps a CTA), CTAs) the split-K test forces for a call: every tile split
    over every SM; over 5 CTAs, each with whole tiles first (the call's part wave and one whole
    wave split); a few tiles split over every SM beside whole ones; and one K step a CTA where
    a tile's steps fit the SMs (a tile's steps in as many CTAs, most of them neither its first
    nor its last)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tiles, k_steps = seg.tile_count(world, n), -(-k // seg.tiles.block_k)

    def case(split: int, ctas: int, steps: int = 0) -> tuple[tuple[int, int], int]:
        return (split, steps or -(-split * k_steps // ctas)), ctas

    cases = {case(tiles, sms), case(min(tiles, tiles % 5 + 5), 5), case(min(tiles, 3), sms)}
    if sms // k_steps >= 1:
        cases.add(case(min(tiles, sms // k_steps), sms, 1))
    return sorted(cases)


def test_fitted_gemm_split_k_matches_reference():
    """Split K (ops/segments.split_k_tiles: a call's whole tiles first, then the K steps of its
    last tiles dealt out to the CTAs, a tile's sums from the CTAs before the one holding its
    last step added there) lands the rows test_fitted_gemm_matches_reference asks for, within
    its bounds, bf16 and fp16, both layouts, tiles of 128- and 64-row consumers, weight tiles
    past N, K with a tail, every tile split or some, a tile's steps over one CTA or many; each
    case twice on new inputs (a flag left up would hand the second call the first call's
    sums), its flags all down after; and e4m3 per tensor within the FP8 test's bounds."""
    _skip_without_fitted()
    from megatron_tokenweave.ops.segments import FP8_BLOCK_K, fit_tiles, segments

    dev = torch.device("cuda", 0)
    failures, cases, seed = [], 0, 9000
    for dtype in (torch.bfloat16, torch.float16):
        for (n, k) in ((3584, 2368), (1000, 200)):
            for layout, world, inbox, rows in _loopback_calls(n, dtype, dev):
                for block_rows in (72, 176, 200):
                    seg = segments(layout, world, rows, hidden=n, k=k, ctas=132,
                                   tiles=fit_tiles(block_rows, True))
                    for split, ctas in _split_cases(seg, world, n, k):
                        for again in range(2):
                            seed += 1
                            bad = _fitted_case(inbox, layout, world, seed % world, rows, k, n,
                                               block_rows, True, dtype, seed % 2 == 0, seed,
                                               ctas=ctas, split=split)
                            flags = inbox.split_work(0)[0]
                            if not bad and flags.any():
                                bad = f"{int(flags.count_nonzero())} flags left up"
                            cases += 1
                            if bad:
                                failures.append((dtype, n, k, layout.value, world, rows,
                                                 block_rows, split, ctas, again, bad))
    for layout, world, inbox, rows in _loopback_calls(1024, torch.bfloat16, dev):
        for block_rows in (72, 200):
            seg = segments(layout, world, rows, hidden=1024, k=3584, ctas=132,
                           tiles=fit_tiles(block_rows, True, FP8_BLOCK_K))
            for split, ctas in _split_cases(seg, world, 1024, 3584):
                seed += 1
                bad, _ = _fp8_case(inbox, layout, world, 0, rows, 3584, 1024, False,
                                   seed % 2 == 0, seed,
                                   fit_tiles(block_rows, True, FP8_BLOCK_K, split=split),
                                   ctas=ctas)
                if not bad and inbox.split_work(0)[0].any():
                    bad = "flags left up"
                cases += 1
                if bad:
                    failures.append(("e4m3", layout.value, world, rows, block_rows, split, ctas,
                                     bad))
    print(f"fitted GEMM, split K: {cases - len(failures)} of {cases} cases exact")
    assert not failures, failures[:10]


# (token extent, CTAs) of the fitted kernel's pairs of CTAs the pair test forces: token tile
# counts odd (a pair's second tile none) and even; one unit of work a cluster or several (3 and
# 6 CTAs: 1 and 3 clusters, the slot ring's phases turning over between units).
FITTED_PAIR_SHAPES = ((72, 132), (136, 6), (176, 132), (176, 3))


def test_fitted_gemm_pairs_match_reference():
    """The cooperative mode in pairs of CTAs (fit_tiles(pair=True): clusters of two sharing
    each weight tile's loads by TMA multicast, each slot released by both CTAs' consumers)
    lands the rows test_fitted_gemm_matches_reference asks for, within its bounds, bf16 and
    fp16, in both layouts, including weight tiles past N (N = 1000) and K with a tail; and e4m3
    per tensor within the FP8 test's bounds. Nothing written where a pair's second token tile
    is none."""
    _skip_without_fitted()
    from megatron_tokenweave.ops.segments import FP8_BLOCK_K, fit_tiles

    dev = torch.device("cuda", 0)
    failures, cases, seed = [], 0, 5000
    for dtype in (torch.bfloat16, torch.float16):
        for (n, k) in ((8192, 4096), (1000, 200)):
            for layout, world, inbox, rows in _loopback_calls(n, dtype, dev):
                for block_rows, ctas in FITTED_PAIR_SHAPES:
                    seed += 1
                    bad = _fitted_case(inbox, layout, world, seed % world, rows, k, n,
                                       block_rows, True, dtype, seed % 2 == 0, seed,
                                       pair=True, ctas=ctas)
                    cases += 1
                    if bad:
                        failures.append((dtype, n, k, layout.value, world, rows, block_rows,
                                         ctas, bad))
    for layout, world, inbox, rows in _loopback_calls(1024, torch.bfloat16, dev):
        for block_rows, ctas in FITTED_PAIR_SHAPES:
            seed += 1
            bad, _ = _fp8_case(inbox, layout, world, 0, rows, 3584, 1024, False, seed % 2 == 0,
                               seed, fit_tiles(block_rows, True, FP8_BLOCK_K, pair=True),
                               ctas=ctas)
            cases += 1
            if bad:
                failures.append(("e4m3", layout.value, world, rows, block_rows, ctas, bad))
    print(f"fitted GEMM in pairs: {cases - len(failures)} of {cases} cases exact")
    assert not failures, failures[:10]


def test_gemm_takes_padded_rows():
    """Operands whose rows are padded past K (a row pitch over K, the padding NaN), as
    ops/gemm_rows.py hands them over where K's bytes are not whole 32-byte sectors: the fitted
    kernel (bf16, e4m3 per tensor in both modes, and in blocks with the tokens as M) and the
    Triton kernels' FP8 forms (large, ping-pong) land the same rows as contiguous operands
    would, within the same bounds; x padded, the weight padded, and both."""
    _skip_without_fitted()
    from dataclasses import replace

    from megatron_tokenweave.kernels.inbox import GemmInbox
    from megatron_tokenweave.ops.segments import FP8_BLOCK_K, LARGE, PINGPONG, fit_tiles
    from megatron_tokenweave.ops.validate import Layout

    dev = torch.device("cuda", 0)
    failures, cases = [], 0
    n, pads = 1024, ((16, 0), (0, 16), (16, 48))
    inbox = GemmInbox.loopback(4, 4 * 1031 + 64, n, torch.bfloat16, dev)
    for i, (rows, pad) in enumerate(itertools.product((7, 513, 1000), pads)):
        for block_rows, cooperative in FITTED_SHAPES:
            # 1848 bf16 in-features: rows of 3696 bytes (K of Qwen2.5-72B's fc2 at TP 8 in e4m3)
            bad = _fitted_case(inbox, Layout.REPLICATED, 4, i % 4, rows, 1848, n, block_rows,
                               cooperative, torch.bfloat16, i % 2 == 0, 300 + i,
                               (pad[0] // 2, pad[1] // 2))
            cases += 1
            if bad:
                failures.append(f"bf16 fitted {block_rows}{'c' * cooperative} rows={rows} "
                                f"pads={pad}: {bad}")
        for tiles in (fit_tiles(136, False, FP8_BLOCK_K), fit_tiles(176, True, FP8_BLOCK_K),
                      replace(LARGE, block_k=FP8_BLOCK_K), replace(PINGPONG,
                                                                   block_k=FP8_BLOCK_K)):
            bad, _ = _fp8_case(inbox, Layout.REPLICATED, 4, 0, rows, 3696, n, False,
                               i % 2 == 1, 400 + i, tiles, pad)
            cases += 1
            if bad:
                failures.append(f"e4m3 {tiles} rows={rows} pads={pad}: {bad}")
        # e4m3 in blocks, the tokens as M
        tiles = fit_tiles(*TOKENS_M_SHAPES[i % len(TOKENS_M_SHAPES)], FP8_BLOCK_K, True, True)
        bad, _ = _fp8_case(inbox, Layout.REPLICATED, 4, 0, rows, 3696, n, True, i % 2 == 0,
                           500 + i, tiles, pad)
        cases += 1
        if bad:
            failures.append(f"e4m3 blocks {tiles} rows={rows} pads={pad}: {bad}")
    inbox.close()
    print(f"padded rows: {cases - len(failures)} of {cases} cases exact")
    assert not failures, "\n".join(failures[:10])


def test_fitted_gemm_launcher_refuses_bad_input():
    """The launcher (kernels/owner_gemm.py) checks a fitted call before the op sees it: bad
    dtype, K not a multiple of 8, a token extent the kernel has no instantiation of, rows past
    x, inbox rows past a slot: TokenWeaveInputError, nothing launched."""
    _skip_without_fitted()
    from dataclasses import replace

    from megatron_tokenweave.kernels.inbox import GemmInbox
    from megatron_tokenweave.kernels.owner_gemm import owner_gemm
    from megatron_tokenweave.ops.segments import fitted_tiles, segments
    from megatron_tokenweave.ops.validate import Layout, TokenWeaveInputError

    dev = torch.device("cuda", 0)
    inbox = GemmInbox.loopback(2, 1024, 512, torch.bfloat16, dev)
    tiles = fitted_tiles(Layout.REPLICATED, 2, 300, 512, 132)
    seg = segments(Layout.REPLICATED, 2, 300, hidden=512, k=256, ctas=132, tiles=tiles)
    x = torch.randn(300, 256, device=dev, dtype=torch.bfloat16)
    w = torch.randn(512, 256, device=dev, dtype=torch.bfloat16)
    bad = [(x.float(), w, seg, "bf16 or fp16"), (x[:, :100].contiguous(), w[:, :100].contiguous(),
                                                 seg, "K a multiple of 8"),
           (x, w, replace(seg, tiles=replace(tiles, block_rows=184)), "multiple of 8 tokens"),
           (x[:200], w, seg, "x has 200"), (x, w, replace(seg, row0=1000), "a slot has")]
    for xx, ww, ss, match in bad:
        with pytest.raises(TokenWeaveInputError, match=match):
            owner_gemm(xx, ww, None, inbox, ss, 0, 132, 1)
    inbox.close()


# --------------------------------------------------------------------- FP8 operands (Triton)
# FP8 tensor cores on Hopper add products into an accumulator of reduced precision (about 14
# mantissa bits; cuBLAS's fast accumulation and Triton's FP8 dot keep it over all of K, the
# block-scaled form over 128): the bound on the kernel's sum is this fraction of the sum of the
# products' magnitudes (a wrong scale or row moves a sum by a whole output, about 2^-5 of it).
FP8_ACC = 2.0 ** -9


def _fp8_case(inbox, layout, world, rank, rows, k, n, blocks, bias_on, seed,
              tiles=None, pads=(0, 0), ctas=132) -> tuple[str | None, float]:
    """One FP8 call of the communicating GEMM (tiles_for(fp8=...), or `tiles`) into a loopback
    inbox, as rank `rank`: None if every owner's slot holds its rows of the dequantized fp32
    product (Fp8Operands.dequantized, + bias) rounded once, within FP8_ACC of the products'
    magnitudes, else what is wrong; and the largest error relative to those magnitudes.
    pads: elements past K in each row of x and of the weight (`_padded`)."""
    from megatron_tokenweave.kernels.owner_gemm import owner_gemm
    from megatron_tokenweave.ops.fp8_operands import Fp8Operands
    from megatron_tokenweave.ops.fp8_rows import FP8_DTYPE
    from megatron_tokenweave.ops.segments import segments
    from megatron_tokenweave.ops.validate import Layout

    dev = torch.device("cuda", 0)
    dtype = inbox.dtype
    sp = layout is Layout.SEQUENCE_PARALLEL
    stride = rows + 5
    seg = segments(layout, world, rows, hidden=n, k=k, ctas=132, first=3,
                   chunk_stride=stride if sp else 0, chunk_row0=11 if sp else 0,
                   fp8="blocks" if blocks else "tensor", tiles=tiles)
    x = _gen(seed, (3 + (world * stride if sp else rows) + 2, k), torch.float32, dev)
    x = x.to(FP8_DTYPE)
    w = _gen(seed + 1, (n, k), torch.float32, dev).to(FP8_DTYPE)
    spread = Fp8Operands(x, w, blocks).shapes(x.shape[0], n, k)
    x_s, w_s = ((0.5 + _gen(seed + 2 + i, shape, torch.float32, dev).abs()).contiguous()
                for i, shape in enumerate(spread))
    ops = Fp8Operands(x_s, w_s * k ** -0.5, blocks)
    bias = _gen(seed + 4, (n,), dtype, dev) if bias_on else None
    for slots in inbox.owner_slots:
        slots.fill_(float("nan"))
    owner_gemm(_padded(x, pads[0]), _padded(w, pads[1]), bias, inbox, seg, 0, ctas, 1, fp8=ops)
    torch.cuda.synchronize()
    xf, wf = ops.dequantized(x, w)
    ref = xf @ wf.t()
    if bias is not None:
        ref += bias.float()
    magnitude = xf.abs() @ wf.abs().t()
    bad = _slots_wrong(inbox, seg, world, 0, ref.to(dtype).float(), dtype,
                       FP8_ACC * magnitude + 1e-4)
    worst = max(((inbox.owner_slots[c][0, seg.row0:seg.row0 + seg.length(c)].float()
                  - ref[seg.first + c * seg.step:seg.first + c * seg.step + seg.length(c)])
                 .abs() / magnitude[seg.first + c * seg.step:
                                    seg.first + c * seg.step + seg.length(c)]).max().item()
                for c in range(world) if seg.length(c))
    return bad, worst


def test_fp8_gemm_matches_dequantized_reference():
    """The communicating GEMM's FP8 forms (per-tensor and blockwise scales,
    ops/fp8_operands.py) land every owner's rows of the dequantized product, rounded once to
    bf16 or fp16 (the inbox's dtype), every other row still poisoned: replicated at TP 2 and 8,
    sequence parallel at TP 4, rows 1-1031 (odd, prime, one past a tile), shards of the model
    families (K 1792-3584, out-features 4096-8192), one with out-features not a multiple of 128
    (a short last weight block in blocks) and one with K past whole 128-deep blocks
    (208: a last block of 80 with its own scales), bias or none, every FP8 tile shape among
    the calls (asserted); every kernel on every call: the pick, the Triton kernel it did not
    pick (per tensor the one-consumer or ping-pong one; in blocks the one-consumer one where
    the pick is fitted), and where it runs the fitted kernel, its token extents (in blocks up
    to 208: consumers of 128 weight rows to 104, of 64 past it) and both modes taken in turn."""
    _skip_without_kernels()
    if torch.cuda.get_device_capability(0) < (8, 9):
        pytest.skip("FP8 tensor cores need sm_89 or newer")
    from dataclasses import replace

    from megatron_tokenweave.kernels._ext import fitted_gemm_available
    from megatron_tokenweave.ops.segments import (
        FP8_BLOCK_K,
        PINGPONG,
        TILES,
        fit_tiles,
        one_consumer_tiles,
        segments,
    )

    dev = torch.device("cuda", 0)
    failures, cases, seed, seen, seen_fitted = [], 0, 100, set(), []
    worst: dict[str, float] = {}
    pingpong = replace(PINGPONG, block_k=FP8_BLOCK_K)
    fits = fitted_gemm_available(dev)
    fitted = {blocks: [fit_tiles(bn, coop, FP8_BLOCK_K, blocks) for bn, coop in shapes] if fits
              else [] for blocks, shapes in ((False, FITTED_SHAPES), (True, FITTED_BLOCK_SHAPES))}
    for dtype in (torch.bfloat16, torch.float16):
        for (n, k) in ((8192, 3584), (5120, 3584), (4096, 1792), (1064, 256), (1000, 208)):
            for layout, world, inbox, rows in _loopback_calls(n, dtype, dev):
                for blocks in (False, True):
                    seed += 5
                    one = replace(one_consumer_tiles(layout, world, rows, n, 132),
                                  block_k=FP8_BLOCK_K)
                    picked = segments(layout, world, rows, hidden=n, k=k, ctas=132,
                                      fitted=fits, fp8="blocks" if blocks else "tensor").tiles
                    # every kernel on every case: the pick and the others
                    triton = (one if picked.fitted else None) if blocks else (
                        one if picked.consumers == 2 else pingpong)
                    shapes = fitted[blocks]
                    for tiles in (picked, *([triton] if triton else []),
                                  *([shapes[len(seen_fitted) % len(shapes)]] if shapes else [])):
                        seed += 1
                        if tiles.fitted:
                            seen_fitted.append(tiles)
                        kernel = "fitted" if tiles.fitted else next(
                            t for t, v in TILES.items()
                            if (v.block_rows, v.block_cols, v.consumers)
                            == (tiles.block_rows, tiles.block_cols, tiles.consumers))
                        name = f"{kernel} {'blocks' if blocks else 'tensor'}"
                        seen.add(name)
                        bad, err = _fp8_case(inbox, layout, world, 0, rows, k, n, blocks,
                                             seed % 2 == 0, seed, tiles)
                        worst[name] = max(worst.get(name, 0.0), err)
                        cases += 1
                        if bad:
                            failures.append(f"{dtype} n={n} k={k} {layout.value} P={world} "
                                            f"rows={rows} {name}: {bad}")
    print(f"FP8 GEMM: {cases - len(failures)} of {cases} cases within bounds, tiles {seen}; "
          "largest |error| / sum of |products|: "
          + ", ".join(f"{name} {err:.2e}" for name, err in worst.items()))
    assert not failures, "\n".join(failures[:12])
    want = {f"{t} tensor" for t in ("large", "wide", "small", "pingpong")}
    want |= {"fitted tensor", "fitted blocks"} if fits else {"large blocks", "small blocks"}
    assert seen >= want, seen


def test_fp8_blocks_tokens_as_m_matches_dequantized_reference():
    """The fitted kernel with the tokens as the MMA's M (e4m3 in blocks,
    ops/segments.fit_tiles(tokens_m=True)) lands every owner's rows of the dequantized product
    (+ bias), rounded once to bf16 or fp16, every other row and slot still poisoned (`_fp8_case`:
    the reference and bounds of the FP8 cases): replicated at TP 2 and 8, sequence parallel at
    TP 4, rows 1-1031 (most not multiples of its 64-token rows: their padded rows never
    stored), x's rows from row 3, out-features not a multiple of 128 (1000, 1064: a short last
    weight block), K with a short last block (208, 3696), bias or none; every weight extent
    (tiles that start anywhere in a weight block, spanning up to three) in both modes, two a
    call in turn."""
    _skip_without_fitted()
    from megatron_tokenweave.ops.segments import FP8_BLOCK_K, fit_tiles

    dev = torch.device("cuda", 0)
    failures, cases, seed, worst = [], 0, 900, 0.0
    for dtype in (torch.bfloat16, torch.float16):
        for (n, k) in ((8192, 3696), (5120, 3584), (1064, 256), (1000, 208)):
            for layout, world, inbox, rows in _loopback_calls(n, dtype, dev):
                for _ in range(2):
                    extent, cooperative = TOKENS_M_SHAPES[cases % len(TOKENS_M_SHAPES)]
                    tiles = fit_tiles(extent, cooperative, FP8_BLOCK_K, True, True)
                    seed += 5
                    bad, err = _fp8_case(inbox, layout, world, 0, rows, k, n, True,
                                         seed % 2 == 0, seed, tiles)
                    worst = max(worst, err)
                    cases += 1
                    if bad:
                        failures.append(f"{dtype} n={n} k={k} {layout.value} P={world} "
                                        f"rows={rows} extent={extent}"
                                        f"{'c' if cooperative else 'p'}: {bad}")
    print(f"FP8 blocks, tokens as M: {cases - len(failures)} of {cases} cases within bounds; "
          f"largest |error| / sum of |products| {worst:.2e}")
    assert not failures, "\n".join(failures[:12])


def test_fp8_gemm_refuses_bad_input():
    """FP8 calls with 16-bit tiles, block scales on the ping-pong kernel or on fitted tiles of
    more than FIT_WIDE_MAX_ROWS tokens, operands not e4m3, scales of the wrong shape or
    dtype, or blockwise K not whole blocks, the tokens as M with scales per tensor:
    TokenWeaveInputError, nothing launched."""
    _skip_without_kernels()
    from dataclasses import replace

    from megatron_tokenweave.kernels.inbox import GemmInbox
    from megatron_tokenweave.kernels.owner_gemm import owner_gemm
    from megatron_tokenweave.ops.fp8_operands import Fp8Operands
    from megatron_tokenweave.ops.fp8_rows import FP8_DTYPE
    from megatron_tokenweave.ops.segments import (
        FP8_BLOCK_K,
        PINGPONG,
        fit_tiles,
        fitted_tiles,
        segments,
    )
    from megatron_tokenweave.ops.validate import Layout, TokenWeaveInputError

    dev = torch.device("cuda", 0)
    inbox = GemmInbox.loopback(2, 1024, 512, torch.bfloat16, dev)
    seg = segments(Layout.REPLICATED, 2, 300, hidden=512, k=256, ctas=132, fp8="tensor")
    tokens_m = segments(Layout.REPLICATED, 2, 300, hidden=512, k=256, ctas=132,
                        tiles=fit_tiles(128, True, FP8_BLOCK_K, True, True))
    pingpong, fitted = (segments(Layout.REPLICATED, 2, 300, hidden=512, k=256, ctas=132,
                                 tiles=replace(t, block_k=FP8_BLOCK_K))
                        for t in (PINGPONG, replace(fitted_tiles(Layout.REPLICATED, 2, 300, 512,
                                                                 132), block_rows=216)))
    x = torch.randn(300, 256, device=dev).to(FP8_DTYPE)
    w = torch.randn(512, 256, device=dev).to(FP8_DTYPE)
    one = torch.ones(1, device=dev)
    blocks = Fp8Operands(torch.ones(2, 300, device=dev), torch.ones(4, 4, device=dev), True)
    bad = [(x, w, segments(Layout.REPLICATED, 2, 300, hidden=512, k=256, ctas=132),
            Fp8Operands(one, one), "128-deep K blocks"),
           (x.to(torch.bfloat16), w, seg, Fp8Operands(one, one), "float8_e4m3fn"),
           (x, w, pingpong, replace(blocks, x_scale_inv=torch.ones(2, 300, device=dev)),
            "one-consumer"),
           (x, w, fitted, replace(blocks, x_scale_inv=torch.ones(2, 300, device=dev)),
            r"16\.\.208 \(block scales\)"),
           (x, w, tokens_m, Fp8Operands(one, one), "tokens as M take e4m3 operands in blocks"),
           (x, w, seg, Fp8Operands(one.double(), one), "float32"),
           (x, w, seg, Fp8Operands(torch.ones(2, device=dev), one), r"\(1,\)"),
           (x, w, seg, replace(blocks, x_scale_inv=torch.ones(2, 301, device=dev)), "x scale"),
           (x[:, :192].contiguous(), w[:, :192].contiguous(),
            segments(Layout.REPLICATED, 2, 300, hidden=512, k=192, ctas=132, fp8="blocks"),
            replace(blocks, x_scale_inv=torch.ones(1, 300, device=dev)), "x scale")]
    for xx, ww, ss, ops, match in bad:
        with pytest.raises(TokenWeaveInputError, match=match):
            owner_gemm(xx, ww, None, inbox, ss, 0, 132, 1, fp8=ops)
    inbox.close()
