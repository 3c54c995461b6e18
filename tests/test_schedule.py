"""The woven schedule's building blocks: the halves (policy + plan_halves), Half, SideStream on
CPU, WeaveChain."""

from __future__ import annotations

import dataclasses
import gc
import itertools

import pytest
import torch

from megatron_tokenweave import schedule
from megatron_tokenweave.config import TokenWeaveConfig
from megatron_tokenweave.policy import SplitPolicy, TableKey
from megatron_tokenweave.schedule import Half, Handoff, Pending, SideStream, WeaveChain

KEY = TableKey("cpu", 2, 64, "float32", False)

ROWS = tuple(range(0, 70)) + (127, 128, 129, 255, 256, 257, 511, 512, 1000, 1031, 4097)
CHUNKS = (1, 2, 4, 8)
CONFIGS = (
    TokenWeaveConfig(split_threshold=0, split_align=1),
    TokenWeaveConfig(split_threshold=0, split_align=128),
    TokenWeaveConfig(split_threshold=0, split_align=128, split_offset=8),
    TokenWeaveConfig(split_threshold=0, split_align=64, split_offset=-8),
    TokenWeaveConfig(split_threshold=100, split_align=16, split_offset=3),
    TokenWeaveConfig(),
    TokenWeaveConfig(split_threshold=10**9),
)


def _all_cases():
    return itertools.product(CONFIGS, CHUNKS, ROWS)


def plan_halves(n: int, chunks: int, cfg: TokenWeaveConfig) -> tuple[Half, ...]:
    """The layer's halves for n rows in each of `chunks` chunks: the split decided by the
    config's policy (no tuning table), the halves by schedule.plan_halves."""
    policy = SplitPolicy(dataclasses.replace(cfg, tuning_table="none"), KEY)
    return schedule.plan_halves(n, cfg, policy.plan(chunks * n).split)


def _should_split(cfg: TokenWeaveConfig, chunks: int, n: int) -> bool:
    return n >= 2 and chunks * n >= max(cfg.split_threshold, 2)


def test_no_split_below_threshold():
    """Fewer than split_threshold rows in all chunks together: one half covering every row."""
    for cfg, chunks, n in _all_cases():
        if chunks * n < cfg.split_threshold:
            assert plan_halves(n, chunks, cfg) == (Half(0, n),), (cfg, chunks, n)


def test_fewer_than_two_rows_a_chunk_never_split():
    """n < 2 rows a chunk is never split, even with the threshold at 0."""
    for cfg, chunks in itertools.product(CONFIGS, CHUNKS):
        for n in (0, 1):
            assert plan_halves(n, chunks, cfg) == (Half(0, n),), (cfg, chunks, n)


def test_split_at_or_above_threshold_gives_two_halves():
    for cfg, chunks, n in _all_cases():
        assert len(plan_halves(n, chunks, cfg)) == (2 if _should_split(cfg, chunks, n) else 1)


def test_halves_cover_every_row_exactly_once():
    """The halves are non-empty, in order, and together cover [0, n) with no overlap or gap."""
    for cfg, chunks, n in _all_cases():
        halves = plan_halves(n, chunks, cfg)
        covered = [row for half in halves for row in range(half.offset, half.offset + half.rows)]
        assert covered == list(range(n)), (cfg, chunks, n, halves)
        if len(halves) == 2:
            assert all(h.rows > 0 for h in halves), (cfg, chunks, n, halves)


def test_first_half_aligned_plus_offset_when_it_fits():
    """The first half is the largest multiple of split_align not above n // 2, plus split_offset,
    whenever that leaves both halves non-empty."""
    for cfg, chunks, n in _all_cases():
        halves = plan_halves(n, chunks, cfg)
        if len(halves) != 2:
            continue
        base = halves[0].rows - cfg.split_offset
        aligned = (n // 2) // cfg.split_align * cfg.split_align
        if 0 < aligned + cfg.split_offset < n:
            assert base % cfg.split_align == 0 and base <= n // 2 < base + cfg.split_align, (
                cfg, chunks, n, halves)


def test_first_half_falls_back_to_midpoint():
    """When the aligned size plus offset is empty or the whole chunk, the split is at n // 2."""
    fallbacks = 0
    for cfg, chunks, n in _all_cases():
        halves = plan_halves(n, chunks, cfg)
        aligned = (n // 2) // cfg.split_align * cfg.split_align + cfg.split_offset
        if len(halves) == 2 and not 0 < aligned < n:
            fallbacks += 1
            assert halves == (Half(0, n // 2), Half(n // 2, n - n // 2)), (cfg, chunks, n)
    assert fallbacks > 0  # the cases above do exercise the fallback


@pytest.mark.parametrize("chunks, n, offset, rows", [(1, 5, 0, 5), (2, 7, 2, 3), (4, 9, 8, 1)])
def test_half_of_is_a_view_of_its_rows(chunks, n, offset, rows):
    t = torch.randn(chunks, n, 8)
    view = Half(offset, rows).of(t)
    assert view.shape == (chunks, rows, 8)
    assert torch.equal(view, t[:, offset : offset + rows])
    view.fill_(float("nan"))
    assert torch.isnan(t[:, offset : offset + rows]).all()
    assert not torch.isnan(t[:, :offset]).any() and not torch.isnan(t[:, offset + rows :]).any()


def test_side_stream_on_cpu_is_a_no_op():
    """On CPU the side stream is disabled: run() executes its body inline, record() gives None,
    wait(None) does nothing."""
    side = SideStream(torch.device("cpu"))
    assert side.enabled is False
    x = torch.randn(4, 8)
    with side.run():
        y = x * 2
    assert torch.equal(y, x * 2)
    assert side.record() is None
    SideStream.wait(None)


def _handoff(residual: torch.Tensor) -> Handoff:
    normed = torch.randn(1, *residual.shape)
    return Handoff(residual, normed, (Half(0, residual.shape[0]),), (Pending(),))


def test_weave_chain_claim_returns_handoff_for_the_same_tensor():
    chain = WeaveChain()
    x = torch.randn(5, 2, 8)
    pending = chain.pending = _handoff(x)
    assert chain.claim(x) is pending
    assert chain.pending is None  # claimed once
    assert chain.claim(x) is None


@pytest.mark.parametrize("other", ["clone", "view", "slice_all", "different"])
def test_weave_chain_claim_is_by_identity_not_value(other):
    """Only the very tensor the predecessor returned claims the hand-off; an equal clone, a view
    of it or any other tensor settles the pending work and gets None."""
    chain = WeaveChain()
    x = torch.randn(5, 2, 8)
    chain.pending = _handoff(x)
    candidate = {
        "clone": lambda: x.clone(),
        "view": lambda: x.view(5, 2, 8),
        "slice_all": lambda: x[:],
        "different": lambda: torch.randn(5, 2, 8),
    }[other]()
    assert chain.claim(candidate) is None
    assert chain.pending is None


def test_weave_chain_claim_without_pending_returns_none():
    assert WeaveChain().claim(torch.randn(3, 1, 8)) is None


def test_weave_chain_successor_links_and_weakrefs():
    chain = WeaveChain()
    a, b, c = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    chain.link(a, b)
    chain.link(b, c)
    assert chain.successor(a) is b and chain.successor(b) is c and chain.successor(c) is None
    del c
    gc.collect()
    assert chain.successor(b) is None  # a weak reference: the chain keeps no layer alive


def test_weave_chain_side_stream_is_shared():
    chain = WeaveChain()
    side = chain.side_stream(torch.device("cpu"))
    assert chain.side_stream(torch.device("cpu")) is side


def test_cross_layer_deferral_off_only_where_megatron_graphs_each_layer():
    """A layer with Megatron's CUDA-graph manager (captured layer by layer) never defers work
    across its boundary, in eager forwards either: a layer's capture cannot wait on side-stream
    work an eager predecessor left pending (CUDA capture isolation, seen on the H200 with the
    dynamic engine at layer scope). Block-scope inference graphs give layers no manager
    (Megatron's own rule, run here) and keep the deferral."""
    from types import SimpleNamespace

    from megatron.core.transformer.enums import InferenceCudaGraphScope
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron_tokenweave.layer import TokenWeaveTransformerLayer

    block = SimpleNamespace(cuda_graph_impl="local", cuda_graph_modules=[],
                            inference_cuda_graph_scope=InferenceCudaGraphScope.block)
    layer = SimpleNamespace(config=block, is_moe_layer=False,
                            submodules_config=SimpleNamespace(self_attention=None, mlp=None))
    TransformerLayer.create_mcore_cudagraph_manager(layer, block)
    assert TokenWeaveTransformerLayer._layer_graphs(layer) is False
    assert TokenWeaveTransformerLayer._layer_graphs(SimpleNamespace()) is False
    managed = SimpleNamespace(cudagraph_manager=object())
    assert TokenWeaveTransformerLayer._layer_graphs(managed) is True


def test_pending_issues_its_remaining_work_once_and_an_unclaimed_handoff_is_finished():
    calls: list[int] = []
    op = Pending(None, lambda: calls.append(1))
    op.wait()
    op.wait()
    assert calls == [1]  # the copy-engine reduction runs exactly once
    chain = WeaveChain()
    x = torch.randn(3, 1, 8)
    chain.pending = Handoff(x, torch.randn(1, 3, 8), (Half(0, 3),),
                            (Pending(None, lambda: calls.append(2)),))
    assert chain.claim(torch.randn(3, 1, 8)) is None  # another tensor: settled, not claimed
    assert calls == [1, 2] and chain.pending is None


def test_fp8_halves_are_whole_granules():
    """FP8 GEMMs' granule (fp8_gemm.FP8_ROWS): on a chunk of whole granules both halves are
    whole granules, non-empty, in order, covering the chunk; below two granules, one half."""
    from megatron_tokenweave.fp8_gemm import FP8_ROWS

    for cfg in CONFIGS:
        for n in range(0, 1100, FP8_ROWS):
            halves = schedule.plan_halves(n, cfg, True, granule=FP8_ROWS)
            covered = [r for h in halves for r in range(h.offset, h.offset + h.rows)]
            assert covered == list(range(n)), (cfg, n, halves)
            assert all(h.rows % FP8_ROWS == 0 for h in halves), (cfg, n, halves)
            assert len(halves) == (2 if n >= 2 * FP8_ROWS else 1), (cfg, n, halves)
            assert all(h.rows > 0 for h in halves) or n == 0
