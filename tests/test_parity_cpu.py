"""GPTModel with the TokenWeave spec vs the stock local spec on gloo ranks at TP=2, 4 and 8 (fp32).

The TP size is the parameter of the fp32 tests (ids tp2, tp4, tp8): for each, every case runs
inside ONE spawned job of that many ranks (module fixture) and the tests assert on what the ranks
returned. Cases at TP=2 (the "tiny" shape): token counts 1, 7, 64, 1000, 1024, 1031 x batch 1, 3
x sequence parallelism off/on x split forced (align 1) / split with align 128 and an offset / no
split / split forced with comm="collectives" (torch.distributed collectives instead of the fused
op) / split forced with comm="copy_engine" (the reference runs each op where its reduction is
due); the TP=2 job also runs the bf16/fp16 models. At TP=4 and 8 (the "tiny-tp8" shape: 16
heads, 8 query groups) the same checks on fewer, odd cases (`_tp_cases`): odd rows per sequence
shard (3, 7, 27), one row per shard (never split), odd replicated row counts, and lengths that
sequence parallelism must refuse (not divisible by the TP size, one of them divisible by 2),
with every split setting above (the aligned one splits 27 rows into 8 + 19 there). The
tokenweave model loads the stock model's state_dict with strict=True. With sequence parallelism
it is built from `get_gpt_decoder_block_tokenweave_spec` and compared with the stock model
WITHOUT sequence parallelism (same math; the stock local spec's final norm refuses SP).

The logits must be within rel 1e-5 of the stock model's. They are often, not always, bit-exact
(measured: 71 of 90 cases at TP=2, worst 2.5e-7; 17 of 55 at TP=4 and 8, worst 5.4e-7): a
split's GEMMs run on a half's rows, which the CPU GEMM may round differently from all rows (at
TP=2 only the splits of odd row counts differ), and from TP=4 on gloo's fp32 sum of the ranks'
partials depends on its algorithm for the message (a half or all rows; the stock all-reduce or
the reference's reduce-scatter: unsplit sequence-parallel cases of 1 row a shard differ).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch
from _dist import (
    build_model,
    forward,
    randomize_norms_,
    record_collective_calls,
    record_fused_calls,
    record_gemm_calls,
    rel_err,
    run_ranks,
    setup_tp,
)

from megatron_tokenweave.config import TokenWeaveConfig
from megatron_tokenweave.models import SHAPES, Shape

TOKENS = (1, 7, 64, 1000, 1024, 1031)
BATCHES = (1, 3)
LAYERS = 3
SHAPE = SHAPES["tiny"]  # hidden 64, 4 heads, 2 query groups (GQA)
ALIGN, OFFSET = 128, 8
SPLITS = {
    "forced": TokenWeaveConfig(split_threshold=0, split_align=1, tuning_table="none"),
    "aligned": TokenWeaveConfig(
        split_threshold=0, split_align=ALIGN, split_offset=OFFSET, tuning_table="none"
    ),
    "none": TokenWeaveConfig(split_threshold=10**9, tuning_table="none"),
    # The stock mechanism (collectives in the activations' dtype) inside the woven schedule.
    "collectives": TokenWeaveConfig(
        split_threshold=0, split_align=1, comm="collectives", tuning_table="none"
    ),
    # The copy-engine path's schedule: each op's reduction deferred to its consumer.
    "copy_engine": TokenWeaveConfig(
        split_threshold=0, split_align=1, comm="copy_engine", tuning_table="none"
    ),
    # The GEMM-fused mechanism (its emulation on gloo: the owner segments, both inbox sets).
    "gemm": TokenWeaveConfig(split_threshold=0, split_align=1, comm="gemm", tuning_table="none"),
    "gemm_whole": TokenWeaveConfig(split_threshold=10**9, comm="gemm", tuning_table="none"),
}
FORCED = ("forced", "collectives", "copy_engine", "gemm")  # split at the midpoint
LOW_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16}
LOW_PRECISION_CASES = ((3, 64), (1, 1000))  # (batch, tokens)
SP_REFUSAL = "First dimension of the tensor should be divisible by tensor parallel size"


def _tp_cases(world: int) -> tuple[tuple[int, int], ...]:
    """(tokens, batch) at TP=world (4 or 8). Rows a chunk with sequence parallelism / without:
    (1, 1): refused / 1 (never split); (world, 1): 1 / world; (world, 3): 3 (halves 1 + 2) /
    3 world; (7 world, 1): 7 / 7 world; (9 world, 3): 27 / 27 world; (2 world + 2, 1): refused
    (divisible by 2, not by world) / 2 world + 2; (37, 3): refused / 111."""
    return ((1, 1), (world, 1), (world, 3), (7 * world, 1), (9 * world, 3),
            (2 * world + 2, 1), (37, 3))


@dataclass(frozen=True)
class Suite:
    """What the job of one TP size runs."""

    shape: Shape
    cases: tuple[tuple[int, int], ...]  # (tokens, batch), each with every SPLITS, SP off and on


SUITES = {
    2: Suite(SHAPE, tuple(itertools.product(TOKENS, BATCHES))),
    4: Suite(SHAPES["tiny-tp8"], _tp_cases(4)),
    8: Suite(SHAPES["tiny-tp8"], _tp_cases(8)),
}
WORLDS = tuple(SUITES)


def _parity_worker(rank: int, world: int, low_precision: bool) -> tuple[dict, dict | None]:
    """(fp32 results by (tokens, batch, sp, split), low-precision results or None)."""
    from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

    setup_tp(world)
    suite = SUITES[world]
    shape = suite.shape
    stock = build_model("stock", shape, LAYERS, world)
    randomize_norms_(stock, seed=11)
    state = stock.state_dict()
    models = {}
    for sp in (False, True):
        for split in SPLITS:
            kind = "tokenweave_block" if sp else "tokenweave"
            model = build_model(kind, shape, LAYERS, world, SPLITS[split], sequence_parallel=sp)
            model.load_state_dict(state, strict=True)
            models[(sp, split)] = model
    gen = torch.Generator().manual_seed(3)  # the same tokens on every rank
    results: dict = {}
    for seq, batch in suite.cases:
        tokens = torch.randint(0, shape.vocab, (batch, seq), generator=gen)
        want = forward(stock, tokens)
        for (sp, split), model in models.items():
            case: dict = {}
            if sp and seq % world:
                # What stock Megatron does with this shape under sequence parallelism.
                try:
                    scatter_to_sequence_parallel_region(torch.randn(seq, batch, shape.hidden))
                    case["stock_raised"] = None
                except Exception as exc:  # noqa: BLE001 - reported to the parent
                    case["stock_raised"] = (type(exc).__name__, str(exc))
                try:
                    forward(model, tokens)
                    case["raised"] = None
                except Exception as exc:  # noqa: BLE001 - reported to the parent
                    case["raised"] = (type(exc).__name__, str(exc))
            else:
                with record_fused_calls() as calls, record_collective_calls() as coll, \
                        record_gemm_calls() as gemm:
                    got = forward(model, tokens)
                case["gemm_calls"] = list(gemm)
                case["err"] = rel_err(got, want)
                case["finite"] = bool(torch.isfinite(got).all())
                case["calls"] = list(calls)
                case["collective_calls"] = list(coll)
            results[(seq, batch, sp, split)] = case
    return results, _low_precision(world, state) if low_precision else None


def _try_forward(model, tokens):
    try:
        return forward(model, tokens), None
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        return None, f"{type(exc).__name__}: {exc}"


def _low_precision(world: int, state: dict) -> dict:
    """bf16/fp16 models: errors of stock and tokenweave logits against the fp32 stock model.

    "cast": built with params_dtype and cast whole to the dtype (what Megatron's Float16Module
    does). "params_dtype": built with params_dtype only, not cast (the norms stay fp32 there,
    in the stock model as in ours), which the stock model runs.
    """
    exact_model = build_model("stock", SHAPE, LAYERS, world)
    exact_model.load_state_dict(state, strict=True)
    gen = torch.Generator().manual_seed(23)
    results: dict = {}
    for flag, dtype in LOW_PRECISION.items():
        kwargs = {"params_dtype": dtype, flag: True}
        for cast in (True, False):
            stock = build_model("stock", SHAPE, LAYERS, world, **kwargs)
            stock.load_state_dict(state, strict=True)
            for sp, comm in itertools.product((False, True) if cast else (False,), FORCED):
                kind = "tokenweave_block" if sp else "tokenweave"
                woven = build_model(kind, SHAPE, LAYERS, world, SPLITS[comm],
                                    sequence_parallel=sp, **kwargs)
                woven.load_state_dict(state, strict=True)
                if cast:
                    stock, woven = stock.to(dtype), woven.to(dtype)
                for batch, seq in LOW_PRECISION_CASES if cast else ((1, 8),):
                    tokens = torch.randint(0, SHAPE.vocab, (batch, seq), generator=gen)
                    exact = forward(exact_model, tokens)
                    want, stock_error = _try_forward(stock, tokens)
                    with record_fused_calls() as calls:
                        got, error = _try_forward(woven, tokens)
                    results[(flag, cast, sp, comm, batch, seq)] = dict(
                        stock_error=stock_error,
                        error=error,
                        dtype=str(got.dtype) if got is not None else None,
                        stock_err=rel_err(want.float(), exact) if want is not None else None,
                        err=rel_err(got.float(), exact) if got is not None else None,
                        calls=len(calls),
                    )
    return results


@pytest.fixture(scope="module")
def tp2_job():
    """The TP=2 job: fp32 cases and the low-precision models (per rank)."""
    return run_ranks(_parity_worker, True, world=2)


@pytest.fixture(scope="module", params=WORLDS, ids=[f"tp{w}" for w in WORLDS])
def world(request) -> int:
    return request.param


@pytest.fixture(scope="module")
def per_rank(world, request):
    """Each rank's fp32 results at TP=world (one job per TP size)."""
    if world == 2:
        return [fp32 for fp32, _ in request.getfixturevalue("tp2_job")]
    return [fp32 for fp32, _ in run_ranks(_parity_worker, False, world=world)]


@pytest.fixture(scope="module")
def low_precision(tp2_job):
    return [low for _, low in tp2_job]


def _cases(per_rank, runnable: bool):
    for rank, results in enumerate(per_rank):
        for (seq, batch, sp, split), case in sorted(results.items()):
            if ("err" in case) == runnable:
                yield rank, seq, batch, sp, split, case


def test_every_case_was_run(per_rank, world):
    want = {(s, b, sp, k) for s, b in SUITES[world].cases for sp in (False, True) for k in SPLITS}
    assert len(per_rank) == world
    for results in per_rank:
        assert set(results) == want


def test_logits_match_stock_fp32(per_rank):
    """Logits equal the stock local-spec model's within rel 1e-5 (max abs diff / max abs)."""
    bad = [
        (rank, seq, batch, sp, split, case["err"])
        for rank, seq, batch, sp, split, case in _cases(per_rank, runnable=True)
        if not (case["finite"] and case["err"] <= 1e-5)
    ]
    assert not bad, f"cases over rel 1e-5 (rank, tokens, batch, sp, split, err): {bad}"


def _expected_halves(seq: int, batch: int, sp: bool, split: str,
                     world: int) -> tuple[int, int]:
    """(rows per chunk, number of halves) the schedule must use for this case."""
    rows = (seq // world if sp else seq) * batch
    halves = 1 if split in ("none", "gemm_whole") or rows < 2 else 2
    return rows, halves


def test_fused_path_ran_two_calls_per_layer_per_half(per_rank, world):
    """The woven path ran: 2 fused calls per layer per half, halves covering every row, over
    every rank's shard (TP size chunks) with sequence parallelism."""
    for rank, seq, batch, sp, split, case in _cases(per_rank, runnable=True):
        rows, halves = _expected_halves(seq, batch, sp, split, world)
        calls = case["calls"]
        where = (rank, seq, batch, sp, split, calls[:8])
        assert len(calls) == 2 * LAYERS * halves, where
        assert all(chunks == (world if sp else 1) for chunks, _ in calls), where
        per_layer = [calls[i : i + 2 * halves] for i in range(0, len(calls), 2 * halves)]
        for layer_calls in per_layer:
            attn, mlp = layer_calls[:halves], layer_calls[halves:]
            assert sum(r for _, r in attn) == rows, where
            assert attn == mlp, where
            assert all(r > 0 for _, r in attn), where


def test_split_on_runs_two_halves(per_rank, world):
    """With the split forced (threshold 0, align 1) every case with >= 2 rows a chunk runs two
    halves, split at the midpoint: [0, rows // 2) and [rows // 2, rows)."""
    for rank, seq, batch, sp, split, case in _cases(per_rank, runnable=True):
        rows, _ = _expected_halves(seq, batch, sp, split, world)
        if split not in FORCED or rows < 2:
            continue
        chunks = world if sp else 1
        first_layer = case["calls"][:4]
        want = [(chunks, rows // 2), (chunks, rows - rows // 2)] * 2
        assert first_layer == want, (rank, seq, batch, sp)


def test_comm_collectives_runs_every_call_through_collectives(per_rank):
    """comm="collectives": every fused-op call of the layer went to the collectives path (and
    no other configuration's did)."""
    for rank, seq, batch, sp, split, case in _cases(per_rank, runnable=True):
        want = [rows for _, rows in case["calls"]] if split == "collectives" else []
        assert case["collective_calls"] == want, (rank, seq, batch, sp, split)


def test_gemm_mechanism_pairs_each_gemm_with_its_consumer(per_rank, world):
    """comm="gemm": every fused op is the consumer of the communicating GEMM issued just before
    it, with the same inbox set and rows; the halves use sets 0 and 1 and never share inbox
    rows (sequence parallel: each half keeps its chunk row index; replicated: half B's
    segments start after half A's); no other configuration runs the mechanism."""
    for rank, seq, batch, sp, split, case in _cases(per_rank, runnable=True):
        gemm = case["gemm_calls"]
        where = (rank, seq, batch, sp, split, gemm[:4])
        if not split.startswith("gemm"):
            assert gemm == [], where
            continue
        rows, halves = _expected_halves(seq, batch, sp, split, world)
        assert len(gemm) == 2 * 2 * LAYERS * halves, where
        pairs = [gemm[i:i + 2] for i in range(0, len(gemm), 2)]
        assert all(g[0] == "gemm" and r[0] == "reduce" and g[1:] == r[1:] for g, r in pairs), where
        sets = [g[1] for g, _ in pairs]
        assert sets == list(range(halves)) * (2 * LAYERS), where
        spans = {g[1]: range(g[2], g[2] + g[3]) for g, _ in pairs}
        if halves == 2:
            assert not set(spans[0]) & set(spans[1]), where
        totals = {g[1]: g[4] for g, _ in pairs}
        assert sum(totals.values()) == rows * (world if sp else 1), where


def test_aligned_split_uses_alignment_and_offset(per_rank, world):
    """With split_align=128 and split_offset=8 the first half is a multiple of 128 plus 8 (the
    largest not above half the rows), or the midpoint when that does not fit."""
    for rank, seq, batch, sp, split, case in _cases(per_rank, runnable=True):
        rows, halves = _expected_halves(seq, batch, sp, split, world)
        if split != "aligned" or halves == 1:
            continue
        first = case["calls"][0][1]
        aligned = (rows // 2) // ALIGN * ALIGN + OFFSET
        if 0 < aligned < rows:
            assert first == aligned and (first - OFFSET) % ALIGN == 0, (rank, seq, batch, sp)
        else:
            assert first == rows // 2, (rank, seq, batch, sp)


def test_no_split_runs_one_half(per_rank, world):
    """With a huge threshold there is one half: 2 fused calls per layer over all rows."""
    for _, seq, batch, sp, split, case in _cases(per_rank, runnable=True):
        if split == "none":
            rows, _ = _expected_halves(seq, batch, sp, split, world)
            assert case["calls"] == [(world if sp else 1, rows)] * (2 * LAYERS)


def test_sequence_parallel_refuses_lengths_not_divisible_by_tp(per_rank, world):
    """Sequence lengths not divisible by the TP size with sequence parallelism (1, 7, 1031 at
    TP=2; 1, 10, 37 at TP=4; 1, 18, 37 at TP=8): stock Megatron refuses them (its scatter to the
    sequence-parallel region raises AssertionError: the first dimension must be divisible by the
    TP size), and the tokenweave model raises that same AssertionError."""
    want = {(seq, True) for seq, _ in SUITES[world].cases if seq % world}
    assert len({seq for seq, _ in want}) == 3, want
    refused = list(_cases(per_rank, runnable=False))
    assert {(seq, sp) for _, seq, _, sp, _, _ in refused} == want
    for rank, seq, batch, _sp, split, case in refused:
        assert case["stock_raised"] == ("AssertionError", SP_REFUSAL), (rank, seq, batch)
        assert case["raised"] == ("AssertionError", SP_REFUSAL), (rank, seq, batch, split, case)


@pytest.mark.parametrize("flag", sorted(LOW_PRECISION))
def test_low_precision_within_rounding_of_fp32(low_precision, flag):
    """bf16/fp16 models (cast whole to the dtype, as Float16Module does), split forced, SP off
    and on, fused op and collectives: the tokenweave logits are within 2 ulps of the dtype
    (relative to the largest logit) of the fp32 stock model's, like the stock model's own
    low-precision logits, and the woven path ran (4 calls per layer)."""
    dtype = LOW_PRECISION[flag]
    bound = 2 * torch.finfo(dtype).eps
    for rank, results in enumerate(low_precision):
        cases = {k: v for k, v in results.items() if k[0] == flag and k[1]}
        assert len(cases) == 2 * len(FORCED) * len(LOW_PRECISION_CASES)
        for key, case in cases.items():
            assert case["stock_error"] is None and case["error"] is None, (rank, key, case)
            assert case["dtype"] == str(dtype), (rank, key, case)
            assert case["stock_err"] <= bound, (rank, key, case)  # the yardstick holds
            assert case["err"] <= bound, (rank, key, case)
            assert case["calls"] == 4 * LAYERS, (rank, key, case)


@pytest.mark.parametrize("flag", sorted(LOW_PRECISION))
def test_params_dtype_model_without_cast_runs_like_stock(low_precision, flag):
    """A model built with params_dtype=bf16/fp16 and not cast (its norm weights stay fp32, in
    the stock local spec as in ours) runs with the stock spec; the tokenweave model must run it
    too (fused path, or the stock fallback) and give logits within 2 ulps of the fp32 model."""
    bound = 2 * torch.finfo(LOW_PRECISION[flag]).eps
    for rank, results in enumerate(low_precision):
        cases = {k: v for k, v in results.items() if k[0] == flag and not k[1]}
        assert cases
        for key, case in cases.items():
            assert case["stock_error"] is None, (rank, key, case)
            assert case["error"] is None, (rank, key, case["error"])
            assert case["err"] <= bound, (rank, key, case)
