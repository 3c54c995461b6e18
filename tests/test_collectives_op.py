"""The fused op's `comm="collectives"` path (torch.distributed collectives in the activations'
dtype, then add and RMSNorm: the stock mechanism) on 2 gloo ranks, against float64 on the same
random inputs.

Its numerics are the stock layer's, not the fused kernel's: the reduced sum is rounded to the
dtype, then the residual add is rounded, then the norm of that rounded row. So the expected
values are computed the same way in float64 (each rounding a correctly rounded fp64 -> dtype
cast): `residual_out` must match bit for bit, `normed_out` within half an ulp of the dtype.
Cases: both layouts, with and without a norm weight, n in {0, 1, 3, 127, 128}, H in {8, 136},
fp32/bf16/fp16; outputs poisoned with NaN, `normed_out` a strided view whose gaps must stay NaN,
residual_out separate or aliasing the residual. All cases run in ONE spawned job.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from _dist import run_ranks
from test_reference_op import ATOL, DTYPES, EPS, LAYOUTS, NS, RTOL  # one tolerance definition

from megatron_tokenweave.ops import Layout

HS = (8, 136)
GAP = 3
CASES = list(itertools.product(LAYOUTS, (True, False), NS, HS, DTYPES))


def _expected(partials, residuals, weight, layout, rank, dtype):
    """(residual_out, normed_out) of rank `rank` with the stock rounding steps, in float64."""
    reduced = partials.double().sum(dim=0).to(dtype)  # [chunks, n, H], one rounding (2 ranks)
    mine = reduced[rank] if layout is Layout.SEQUENCE_PARALLEL else reduced[0]
    y = (mine.double() + residuals[rank].double()).to(dtype)
    if weight is None:
        return y, None

    def norm(rows):
        rows = rows.double()
        return rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()

    if layout is Layout.SEQUENCE_PARALLEL:  # every rank's normed rows, gathered
        ys = [(reduced[r].double() + residuals[r].double()).to(dtype) for r in range(len(reduced))]
        return y, torch.stack([norm(v) for v in ys])
    return y, norm(y)[None]


def _worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from megatron_tokenweave.communicator import Communicator

    results = {}
    for index, (layout, with_weight, n, hidden, dtype) in enumerate(CASES):
        gen = torch.Generator().manual_seed(100 + index)  # the same inputs on every rank
        chunks = world if layout is Layout.SEQUENCE_PARALLEL else 1
        partials = torch.randn(world, chunks, n, hidden, generator=gen).to(dtype)
        residuals = torch.randn(world, n, hidden, generator=gen).to(dtype)
        weight = (1 + 0.5 * torch.randn(hidden, generator=gen)).to(dtype) if with_weight else None
        want_y, want_normed = _expected(partials, residuals, weight, layout, rank, dtype)
        ws = Communicator(dist.group.WORLD, max(chunks * n, 1), hidden, dtype, torch.device("cpu"),
                       "reference")
        case = {}
        for alias in (False, True):
            partial = ws.partial[: chunks * n].view(chunks, n, hidden)
            partial.copy_(partials[rank])
            residual = residuals[rank].clone()
            residual_out = residual if alias else torch.full_like(residual, float("nan"))
            buf = torch.full((chunks, n + GAP, hidden), float("nan"), dtype=dtype)
            normed_out = buf[:, :n] if with_weight else None
            ws.allreduce_rmsnorm(partial, residual, weight, EPS, residual_out, normed_out, layout,
                                 comm="collectives")
            normed_ratio = 0.0
            if with_weight and n:
                err = (normed_out.double() - want_normed).abs()
                normed_ratio = (err / (ATOL + RTOL[dtype] * want_normed.abs())).max().item()
                normed_ratio = float("inf") if normed_ratio != normed_ratio else normed_ratio
            case[alias] = dict(
                residual_exact=torch.equal(residual_out, want_y),
                normed=normed_ratio,
                gaps_untouched=bool(torch.isnan(buf[:, n:]).all()),
                unnormed_untouched=with_weight or bool(torch.isnan(buf).all()),
            )
        results[(layout.value, with_weight, n, hidden, str(dtype))] = case
    return results


@pytest.fixture(scope="module")
def per_rank():
    return run_ranks(_worker)


def test_every_case_ran(per_rank):
    for results in per_rank:
        assert len(results) == len(CASES)


@pytest.mark.parametrize("alias", (False, True))
def test_residual_out_is_the_stock_rounding_bit_for_bit(per_rank, alias):
    bad = [(r, k) for r, res in enumerate(per_rank) for k, c in res.items()
           if not c[alias]["residual_exact"]]
    assert not bad, bad


@pytest.mark.parametrize("alias", (False, True))
def test_normed_out_within_half_an_ulp_and_only_its_rows(per_rank, alias):
    for rank, results in enumerate(per_rank):
        for key, case in results.items():
            c = case[alias]
            assert c["normed"] <= 1.0, (rank, key, c)
            assert c["gaps_untouched"] and c["unnormed_untouched"], (rank, key, c)
