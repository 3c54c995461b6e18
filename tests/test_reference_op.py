"""The reference fused op (all-reduce + residual add + RMSNorm) against a single-process
computation in float64 on the same random inputs, on 2 gloo ranks.

Cases: Layout.SEQUENCE_PARALLEL (partial [P, n, H]) and Layout.REPLICATED ([1, n, H]); with a norm
weight and without (add only); residual_out separate (poisoned with NaN) or aliasing residual;
normed_out a strided view (chunk stride (n + GAP) * H) into a NaN-filled buffer, so unwritten rows
and writes into the gaps both show; n in {0, 1, 3, 127, 128}; H in {8, 64, 136}; fp32/bf16/fp16.
The reference accumulates in fp32 and rounds once, so results are within half an ulp of the dtype
of the exact value. Every case also runs through `Communicator.allreduce_rmsnorm` with a
reference-backend communicator, whose results must be bit-identical.
All cases run in ONE spawned job; the tests assert on what the ranks returned.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from _dist import run_ranks

from megatron_tokenweave.ops import Layout

NS = (0, 1, 3, 127, 128)
HS = (8, 64, 136)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LAYOUTS = (Layout.SEQUENCE_PARALLEL, Layout.REPLICATED)
EPS = 1e-5
GAP = 5
# |got - exact| <= ATOL + RTOL * |exact|: half an ulp of the dtype (one rounding of an fp32 result;
# a second rounding would show as errors up to one ulp) plus fp32 accumulation error.
RTOL = {torch.float32: 1e-6, torch.bfloat16: 1.05 * 2.0**-8, torch.float16: 1.05 * 2.0**-11}
ATOL = 1e-5

CASES = list(itertools.product(LAYOUTS, (True, False), NS, HS, DTYPES))


def _case_inputs(world, layout, with_weight, n, hidden, dtype, seed):
    """Every rank's inputs (the same generator on every rank) and the exact float64 outputs."""
    gen = torch.Generator().manual_seed(seed)
    chunks = world if layout is Layout.SEQUENCE_PARALLEL else 1
    partials = torch.randn(world, chunks, n, hidden, generator=gen).to(dtype)
    residuals = torch.randn(world, n, hidden, generator=gen).to(dtype)
    weight = (1.0 + 0.5 * torch.randn(hidden, generator=gen)).to(dtype) if with_weight else None
    reduced = partials.double().sum(dim=0)  # [chunks, n, H]
    if layout is Layout.SEQUENCE_PARALLEL:
        y = reduced + residuals.double()  # chunk c = rank c's rows
    else:
        y = reduced[0].unsqueeze(0) + residuals.double()  # rank r: every row, its own residual
    normed = None
    if with_weight:
        normed = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()
    return partials, residuals, weight, y, normed


def _ratio(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> float:
    """max |got - want| / (ATOL + RTOL |want|): <= 1 passes; inf on NaN."""
    if got.numel() == 0:
        return 0.0
    err = (got.double() - want).abs() / (ATOL + RTOL[dtype] * want.abs())
    value = err.max().item()
    return float("inf") if value != value else value


def _reference_worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from megatron_tokenweave.communicator import Communicator
    from megatron_tokenweave.ops import fused_allreduce_rmsnorm_reference

    group = dist.group.WORLD
    results = {}
    for index, (layout, with_weight, n, hidden, dtype) in enumerate(CASES):
        partials, residuals, weight, y, normed = _case_inputs(
            world, layout, with_weight, n, hidden, dtype, seed=index
        )
        chunks = partials.shape[1]
        want_y = y[rank]
        if normed is not None:
            want_normed = normed if layout is Layout.SEQUENCE_PARALLEL else normed[rank][None]
        case = {}
        for alias in (False, True):
            partial = partials[rank].clone()
            residual = residuals[rank].clone()
            residual_out = residual if alias else torch.full_like(residual, float("nan"))
            buf = torch.full((chunks, n + GAP, hidden), float("nan"), dtype=dtype)
            normed_out = buf[:, :n] if with_weight else None
            fused_allreduce_rmsnorm_reference(
                partial, residual, weight, EPS, residual_out, normed_out, layout, group
            )
            case[alias] = dict(
                residual=_ratio(residual_out, want_y, dtype),
                normed=_ratio(normed_out, want_normed, dtype) if with_weight else 0.0,
                gaps_untouched=bool(torch.isnan(buf[:, n:]).all()),
                unnormed_untouched=with_weight or bool(torch.isnan(buf).all()),
                partial_unchanged=torch.equal(partial, partials[rank]),
            )
            if not alias:
                direct = (residual_out.clone(), buf.clone())

        # The same op through the dispatch, inputs and outputs in the workspace's buffers.
        ws = Communicator(group, max(chunks * n, 1), hidden, dtype, torch.device("cpu"),
                          "reference")
        partial = ws.partial[: chunks * n].view(chunks, n, hidden)
        partial.copy_(partials[rank])
        ws.normed.fill_(float("nan"))
        normed_out = ws.normed[: chunks * n].view(chunks, n, hidden) if with_weight else None
        residual_out = torch.full_like(residuals[rank], float("nan"))
        ws.allreduce_rmsnorm(
            partial, residuals[rank].clone(), weight, EPS, residual_out, normed_out, layout
        )
        same_normed = True
        if with_weight:
            same_normed = torch.equal(normed_out.nan_to_num(7.0), direct[1][:, :n].nan_to_num(7.0))
        case["dispatch"] = dict(
            backend=ws.backend,
            same_residual=torch.equal(residual_out.nan_to_num(7.0), direct[0].nan_to_num(7.0)),
            same_normed=same_normed,
        )
        results[(layout.value, with_weight, n, hidden, str(dtype))] = case
    return results


@pytest.fixture(scope="module")
def per_rank():
    return run_ranks(_reference_worker)


def _key(layout, with_weight, n, hidden, dtype):
    return (layout.value, with_weight, n, hidden, str(dtype))


def test_every_case_ran(per_rank):
    for results in per_rank:
        assert set(results) == {_key(*case) for case in CASES}


@pytest.mark.parametrize("alias", [False, True], ids=["separate_out", "aliased_out"])
def test_residual_out_matches_float64_within_half_ulp(per_rank, alias):
    """residual_out = sum over ranks of partial + this rank's residual (its chunk's rows under
    sequence parallelism), within half an ulp of the exact value, aliased or not."""
    bad = [
        (rank, key, results[key][alias]["residual"])
        for rank, results in enumerate(per_rank)
        for key in results
        if not results[key][alias]["residual"] <= 1.0
    ]
    assert not bad, bad


@pytest.mark.parametrize("alias", [False, True], ids=["separate_out", "aliased_out"])
def test_normed_out_matches_float64_within_half_ulp(per_rank, alias):
    """normed_out = RMSNorm(y) * weight of every chunk on every rank, within half an ulp."""
    bad = [
        (rank, key, results[key][alias]["normed"])
        for rank, results in enumerate(per_rank)
        for key in results
        if key[1] and not results[key][alias]["normed"] <= 1.0
    ]
    assert not bad, bad


def test_strided_normed_out_writes_only_its_rows(per_rank):
    """A normed_out view with chunk stride (n + GAP) * H leaves the GAP rows after every chunk
    untouched (still NaN); without a weight nothing at all is written there."""
    for rank, results in enumerate(per_rank):
        for key, case in results.items():
            for alias in (False, True):
                assert case[alias]["gaps_untouched"], (rank, key, alias)
                assert case[alias]["unnormed_untouched"], (rank, key, alias)


def test_partial_is_not_modified(per_rank):
    """The op reads partial and leaves it as it was (it is an input of the op)."""
    modified = sorted(
        {(key[0], key[4]) for results in per_rank for key, case in results.items()
         if not (case[False]["partial_unchanged"] and case[True]["partial_unchanged"])}
    )
    assert not modified, f"partial was modified in place for (layout, dtype): {modified}"


def test_dispatch_through_reference_workspace_is_bit_identical(per_rank):
    """`Communicator.allreduce_rmsnorm` on the reference backend gives exactly the reference
    op's outputs, with partial and normed_out in the communicator's buffers."""
    for rank, results in enumerate(per_rank):
        for key, case in results.items():
            dispatch = case["dispatch"]
            assert dispatch["backend"] == "reference", (rank, key)
            assert dispatch["same_residual"] and dispatch["same_normed"], (rank, key)
