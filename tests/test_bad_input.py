"""Bad input: every argument the fused op cannot take raises TokenWeaveInputError with a clear
message and writes nothing; capacity, config and backend errors; and the documented fallbacks
(LayerNorm, hidden size not a multiple of 8, TP=1, gradients enabled) run the stock layer path.

Op-level cases run in-process on a 1-rank gloo group; model-level cases at TP=2 run in ONE
spawned 2-rank job whose results the tests assert on.
"""

from __future__ import annotations

import logging

import pytest
import torch
from _dist import (
    build_model,
    causal_mask,
    randomize_norms_,
    record_fused_calls,
    rel_err,
    run_ranks,
    setup_tp,
)

from megatron_tokenweave.communicator import Communicator, WorkspaceCapacityError, agree
from megatron_tokenweave.config import TokenWeaveConfig
from megatron_tokenweave.models import SHAPES, Shape
from megatron_tokenweave.ops import Layout, TokenWeaveInputError, fused_allreduce_rmsnorm_reference

EPS = 1e-5
N, H = 5, 16
CPU = torch.device("cpu")
SHAPE = SHAPES["tiny"]
# hidden 60: not a multiple of 8. 6 heads (head dim 10): with 4 heads the head dim is 15 and
# stock Megatron's RoPE itself fails on odd head dims.
ODD_HIDDEN = Shape(60, 160, 6, 2, vocab=256)
CAPACITY = 32


# --------------------------------------------------------------------------- op arguments
def _valid_args(dtype=torch.float32, n=N, hidden=H, layout=Layout.SEQUENCE_PARALLEL):
    """Valid arguments for a 1-rank group (one chunk), outputs poisoned with NaN."""
    gen = torch.Generator().manual_seed(n * 1000 + hidden)
    return dict(
        partial=torch.randn(1, n, hidden, generator=gen).to(dtype),
        residual=torch.randn(n, hidden, generator=gen).to(dtype),
        weight=(1.0 + torch.randn(hidden, generator=gen)).to(dtype),
        residual_out=torch.full((n, hidden), float("nan"), dtype=dtype),
        normed_out=torch.full((1, n, hidden), float("nan"), dtype=dtype),
        layout=layout,
    )


def _with(**changes):
    def make():
        args = _valid_args()
        args.update({k: (v() if callable(v) else v) for k, v in changes.items()})
        return args
    return make


def _all_dtype(dtype, hidden=H):
    return lambda: _valid_args(dtype=dtype, hidden=hidden)


def _non_contiguous_partial():
    args = _valid_args()
    args["partial"] = torch.randn(1, H, N).transpose(1, 2)  # [1, N, H], columns strided
    return args


def _strided_rows_normed_out():
    args = _valid_args()
    args["normed_out"] = torch.full((1, N, 2 * H), float("nan"))[:, :, :H]
    return args


BAD_ARGS = {
    "int32_partial": (_with(partial=lambda: torch.randint(-3, 3, (1, N, H), dtype=torch.int32)),
                      "unsupported dtype torch.int32"),
    "float64_everywhere": (_all_dtype(torch.float64), "unsupported dtype torch.float64"),
    "hidden_not_multiple_of_8": (_all_dtype(torch.float32, hidden=12), "not a multiple of 8"),
    "non_contiguous_partial": (_non_contiguous_partial, "partial must be contiguous"),
    "partial_not_3d": (_with(partial=lambda: torch.randn(N, H)), r"partial must be \[chunks"),
    "residual_shape": (_with(residual=lambda: torch.randn(N + 1, H)),
                       r"residual must have shape \(5, 16\)"),
    "residual_dtype": (_with(residual=lambda: torch.randn(N, H, dtype=torch.bfloat16)),
                       "residual dtype torch.bfloat16 != partial dtype torch.float32"),
    "residual_out_shape": (_with(residual_out=lambda: torch.full((N, 8), float("nan"))),
                           "residual_out must have shape"),
    "residual_out_non_contiguous": (
        _with(residual_out=lambda: torch.full((H, N), float("nan")).t()),
        "residual_out must be contiguous"),
    "normed_out_missing_with_weight": (_with(normed_out=None), "normed_out is required"),
    "normed_out_without_weight": (_with(weight=None), "normed_out given without a norm weight"),
    "normed_out_shape": (_with(normed_out=lambda: torch.full((1, N - 1, H), float("nan"))),
                         "normed_out must have shape"),
    "normed_out_rows_not_dense": (_strided_rows_normed_out, "rows must be dense"),
    "sequence_parallel_chunks_not_tp_size": (
        _with(partial=lambda: torch.randn(2, N, H), normed_out=lambda: torch.zeros(2, N, H)),
        r"sequence_parallel layout needs partial.shape\[0\] == 1 \(TP group of 1\), got 2"),
    "replicated_more_than_one_chunk": (
        _with(partial=lambda: torch.randn(2, N, H), layout=Layout.REPLICATED),
        r"replicated layout needs partial.shape\[0\] == 1"),
    "weight_shape": (_with(weight=lambda: torch.ones(H + 8)), r"weight must have shape \(16,\)"),
    "weight_dtype": (_with(weight=lambda: torch.ones(H, dtype=torch.float16)),
                     "weight must be torch.float32"),
    "layout_is_a_string": (_with(layout="sequence_parallel"), "layout must be a Layout"),
    "layout_is_none": (_with(layout=None), "layout must be a Layout"),
}


@pytest.mark.parametrize("via", ["reference", "dispatch"])
@pytest.mark.parametrize("case", sorted(BAD_ARGS))
def test_bad_op_arguments_raise_and_write_nothing(single_rank_group, case, via):
    """Each bad argument raises TokenWeaveInputError naming the problem; outputs stay NaN."""
    make, message = BAD_ARGS[case]
    args = make()
    residual_out, normed_out = args["residual_out"], args["normed_out"]
    before = [t.clone() for t in (residual_out, normed_out) if t is not None]
    with pytest.raises(TokenWeaveInputError, match=message):
        if via == "reference":
            fused_allreduce_rmsnorm_reference(
                args["partial"], args["residual"], args["weight"], EPS, residual_out, normed_out,
                args["layout"], single_rank_group,
            )
        else:
            comm = Communicator(single_rank_group, 64, H, torch.float32, CPU, "reference")
            comm.allreduce_rmsnorm(
                args["partial"], args["residual"], args["weight"], EPS, residual_out,
                normed_out, args["layout"],
            )
    after = [t for t in (residual_out, normed_out) if t is not None]
    for old, new in zip(before, after, strict=True):
        assert torch.equal(old.isnan(), new.isnan()) and torch.equal(
            old.nan_to_num(3.0), new.nan_to_num(3.0))


@pytest.mark.parametrize("comm", ["fused", "copy_engine", "collectives"])
@pytest.mark.parametrize(("phase", "layout", "message"), [
    ("later", Layout.REPLICATED, "phase must be one of"),
    ("reduce", Layout.SEQUENCE_PARALLEL, "runs in phases only when it gathers no normed rows"),
    ("transfer", Layout.SEQUENCE_PARALLEL, "runs in phases only when it gathers no normed rows"),
])
def test_bad_phase_raises_on_every_backend(single_rank_group, comm, phase, layout, message):
    """A wrong phase fails the same way on the CPU backends as on the kernel (where the op would
    run twice or skip its gather), before anything is written."""
    args = _valid_args(layout=layout)
    ws = Communicator(single_rank_group, 64, H, torch.float32, CPU, "reference")
    with pytest.raises(TokenWeaveInputError, match=message):
        ws.allreduce_rmsnorm(args["partial"], args["residual"], args["weight"], EPS,
                             args["residual_out"], args["normed_out"], layout, comm=comm,
                             phase=phase)
    assert args["residual_out"].isnan().all() and args["normed_out"].isnan().all()


def test_phases_on_a_backend_without_them_run_the_op_once_at_reduce(single_rank_group):
    """Reference backend: "transfer" writes nothing, "reduce" the whole op."""
    args = _valid_args(layout=Layout.REPLICATED)
    ws = Communicator(single_rank_group, 64, H, torch.float32, CPU, "reference")
    call = [args["partial"], args["residual"], args["weight"], EPS, args["residual_out"],
            args["normed_out"], Layout.REPLICATED]
    ws.allreduce_rmsnorm(*call, comm="copy_engine", phase="transfer")
    assert args["residual_out"].isnan().all() and args["normed_out"].isnan().all()
    ws.allreduce_rmsnorm(*call, comm="copy_engine", phase="reduce")
    want_res = torch.full_like(args["residual_out"], float("nan"))
    want_normed = torch.full_like(args["normed_out"], float("nan"))
    fused_allreduce_rmsnorm_reference(args["partial"], args["residual"], args["weight"], EPS,
                                      want_res, want_normed, Layout.REPLICATED, single_rank_group)
    assert torch.equal(args["residual_out"], want_res)
    assert torch.equal(args["normed_out"], want_normed)


def test_input_error_is_a_value_error():
    assert issubclass(TokenWeaveInputError, ValueError)
    assert issubclass(WorkspaceCapacityError, TokenWeaveInputError)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", list(Layout))
def test_valid_arguments_pass_the_checks(single_rank_group, dtype, layout):
    """The baseline every bad case mutates is itself accepted (so each case fails for its own
    reason): every row of the outputs is written."""
    args = _valid_args(dtype=dtype, layout=layout)
    fused_allreduce_rmsnorm_reference(
        args["partial"], args["residual"], args["weight"], EPS, args["residual_out"],
        args["normed_out"], layout, single_rank_group,
    )
    assert torch.isfinite(args["residual_out"]).all() and torch.isfinite(args["normed_out"]).all()


# --------------------------------------------------------------------------- workspace, backend
@pytest.mark.parametrize("capacity", [1, 7, 128])
def test_workspace_capacity(single_rank_group, capacity):
    """Up to max_tokens rows fit; one more raises WorkspaceCapacityError saying how to fix it."""
    ws = Communicator(single_rank_group, capacity, H, torch.bfloat16, CPU, "reference")
    assert ws.partial.shape == ws.normed.shape == (capacity, H)
    assert ws.is_buffer_size_sufficient(capacity) and not ws.is_buffer_size_sufficient(capacity + 1)
    ws.check_capacity(capacity)
    with pytest.raises(WorkspaceCapacityError, match=f"{capacity + 1} token rows .* holds "
                       f"{capacity}.*TOKENWEAVE_MAX_TOKENS"):
        ws.check_capacity(capacity + 1)


def test_kernel_backend_on_cpu_raises_runtime_error(single_rank_group):
    with pytest.raises(RuntimeError, match="backend 'kernel' was requested but cannot run: the "
                       "device is not a CUDA GPU"):
        Communicator(single_rank_group, 8, H, torch.bfloat16, CPU, "kernel")
    with pytest.raises(RuntimeError, match="'kernel' was requested"):
        agree(single_rank_group, CPU, "kernel", H)
    with pytest.raises(RuntimeError, match="hidden size 32776 is above the kernel's 32768"):
        agree(single_rank_group, CPU, "kernel", 32776)


def test_auto_backend_on_cpu_is_reference(single_rank_group):
    assert agree(single_rank_group, CPU, "auto", H).backend == "reference"
    assert agree(single_rank_group, CPU, "auto", 32776).backend == "reference"


def test_outgrown_communicator_stays_until_destroy_communicators(single_rank_group, monkeypatch):
    """A larger max_tokens gets a new communicator and keeps the old one (CUDA graphs captured
    on it replay with its addresses); a smaller one reuses the larger; destroy_communicators
    frees both."""
    from megatron_tokenweave import communicator as comm_mod

    destroyed: list[int] = []
    monkeypatch.setattr(comm_mod.Communicator, "destroy",
                        lambda self: destroyed.append(self.max_tokens))
    monkeypatch.setattr(comm_mod, "_communicators", {})
    monkeypatch.setattr(comm_mod, "_outgrown", [])
    rest = (H, torch.bfloat16, CPU, "reference")
    small = comm_mod.get_communicator(single_rank_group, 16, *rest)
    large = comm_mod.get_communicator(single_rank_group, 64, *rest)
    assert large is not small and large.max_tokens == 64 and destroyed == []
    assert comm_mod.get_communicator(single_rank_group, 16, *rest) is large
    comm_mod.destroy_communicators()
    assert sorted(destroyed) == [16, 64]


# --------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(split_threshold=-1), r"split_threshold must be an int in \[0, inf\], got -1"),
        (dict(comm_ctas_attn=0), r"comm_ctas_attn must be an int in \[1, 128\], got 0"),
        (dict(comm_ctas_mlp=129), r"comm_ctas_mlp must be an int in \[1, 128\], got 129"),
        (dict(comm_ctas_alone="64"), r"comm_ctas_alone must be an int in \[1, 128\], got '64'"),
        (dict(backend="foo"), "backend must be one of"),
        (dict(split_align=0), r"split_align must be an int in \[1, inf\]"),
        (dict(max_tokens=0), r"max_tokens must be an int in \[1, inf\]"),
    ],
)
def test_bad_config_values_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TokenWeaveConfig(**kwargs)


def test_bad_env_value_raises_from_config_and_layer(monkeypatch, single_rank_group):
    """TOKENWEAVE_SPLIT_ALIGN=abc: from_env raises, and so does building a tokenweave layer
    (the layer reads the environment when it is built)."""
    monkeypatch.setenv("TOKENWEAVE_SPLIT_ALIGN", "abc")
    message = "TOKENWEAVE_SPLIT_ALIGN='abc' is not a valid int"
    with pytest.raises(ValueError, match=message):
        TokenWeaveConfig.from_env()
    with pytest.raises(ValueError, match=message):
        build_model("tokenweave", SHAPE, 1, 1)


# --------------------------------------------------------------------------- fallbacks, TP=1
def _capture_log():
    import megatron_tokenweave.log as log_mod

    log_mod._seen.clear()
    messages: list[str] = []

    class Handler(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    logging.getLogger("megatron_tokenweave").addHandler(Handler())
    return messages


def _forward(model, tokens, grad=False):
    from megatron_tokenweave.cpu_compat import cpu_device_scope

    batch, seq = tokens.shape
    positions = torch.arange(seq).unsqueeze(0).expand(batch, -1)
    with cpu_device_scope(), torch.set_grad_enabled(grad):
        return model(tokens, positions, attention_mask=causal_mask(seq))


def test_tp1_falls_back_to_stock(single_rank_group):
    """At TP=1 the woven layer runs the stock forward: same logits, no fused call, logged."""
    messages = _capture_log()
    config = TokenWeaveConfig(split_threshold=0, split_align=1, tuning_table="none")
    stock = build_model("stock", SHAPE, 2, 1)
    randomize_norms_(stock, seed=4)
    woven = build_model("tokenweave", SHAPE, 2, 1, config)
    woven.load_state_dict(stock.state_dict(), strict=True)
    tokens = torch.randint(0, SHAPE.vocab, (3, 9), generator=torch.Generator().manual_seed(1))
    want = _forward(stock, tokens)
    with record_fused_calls() as calls:
        got = _forward(woven, tokens)
    assert calls == []
    assert torch.equal(got, want)
    assert any("tensor-parallel size is 1" in m for m in messages), messages


# --------------------------------------------------------------------------- model level, TP=2
FALLBACKS = {
    "layernorm": dict(shape=SHAPE, normalization="LayerNorm", grad=False,
                      reason="normalization is LayerNorm"),
    "hidden_60": dict(shape=ODD_HIDDEN, normalization="RMSNorm", grad=False,
                      reason="hidden size 60 is not a multiple of 8"),
    "grad_enabled": dict(shape=SHAPE, normalization="RMSNorm", grad=True,
                         reason="gradients are enabled"),
}


def _model_worker(rank: int, world: int) -> dict:
    setup_tp(world)
    messages = _capture_log()
    gen = torch.Generator().manual_seed(8)
    out: dict = {}

    # Capacity first: this model creates the process's workspace for its (group, hidden, dtype).
    small = TokenWeaveConfig(
        max_tokens=CAPACITY, split_threshold=0, split_align=1, tuning_table="none"
    )
    for sp, (batch, seq) in ((False, (3, 11)), (True, (1, 34)), (False, (2, 16)), (True, (2, 16))):
        kind = "tokenweave_block" if sp else "tokenweave"
        model = build_model(kind, SHAPE, 2, world, small, sequence_parallel=sp)
        tokens = torch.randint(0, SHAPE.vocab, (batch, seq), generator=gen)
        try:
            logits = _forward(model, tokens)
            out[("capacity", sp, batch * seq)] = ("ok", bool(torch.isfinite(logits).all()))
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            out[("capacity", sp, batch * seq)] = (type(exc).__name__, str(exc))

    kernel = build_model("tokenweave", SHAPE, 2, world, TokenWeaveConfig(backend="kernel"))
    try:
        _forward(kernel, torch.randint(0, SHAPE.vocab, (1, 8), generator=gen))
        out["kernel"] = None
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        out["kernel"] = (type(exc).__name__, str(exc))

    forced = TokenWeaveConfig(split_threshold=0, split_align=1, tuning_table="none")
    out["validate"] = _validate_flags(world, forced, gen)
    out["outgrown"] = _outgrown_mid_forward(world, forced, gen)
    for name, case in FALLBACKS.items():
        norm = case["normalization"]
        stock = build_model("stock", case["shape"], 2, world, normalization=norm)
        randomize_norms_(stock, seed=9)
        woven = build_model("tokenweave", case["shape"], 2, world, forced, normalization=norm)
        woven.load_state_dict(stock.state_dict(), strict=True)
        results = []
        for batch, seq in ((1, 7), (3, 64)):
            tokens = torch.randint(0, case["shape"].vocab, (batch, seq), generator=gen)
            want = _forward(stock, tokens, case["grad"])
            with record_fused_calls() as calls:
                got = _forward(woven, tokens, case["grad"])
            results.append(dict(calls=len(calls), equal=torch.equal(got.detach(), want.detach()),
                                err=rel_err(got.detach(), want.detach())))
        out[name] = results
    out["log"] = list(messages)
    return out


def _validate_flags(world: int, config: TokenWeaveConfig, gen) -> list:
    """The `validate` flag of every fused-op call over three forwards of one woven model, the
    first of which fails its first (validated) call: what each forward asked the op to check,
    or the error it raised."""
    from megatron_tokenweave.communicator import Communicator

    model = build_model("tokenweave", SHAPE, 2, world, config)
    tokens = torch.randint(0, SHAPE.vocab, (1, 16), generator=gen)
    original, flags = Communicator.allreduce_rmsnorm, []

    def op(*args, **kwargs):
        flags[-1].append(kwargs["validate"])
        if len(flags) == 1 and kwargs["validate"]:
            raise TokenWeaveInputError("injected: the first forward's checks fail")
        return original(*args, **kwargs)

    Communicator.allreduce_rmsnorm = op
    try:
        for _ in range(3):
            flags.append([])
            try:
                _forward(model, tokens)
            except TokenWeaveInputError as exc:
                flags[-1].append(str(exc))
    finally:
        Communicator.allreduce_rmsnorm = original
    return flags


def _outgrown_mid_forward(world: int, config: TokenWeaveConfig, gen) -> dict:
    """A 3-layer woven model whose middle layer asks for a larger workspace than every earlier
    one: the first forward outgrows the workspace between layers 0 and 1, so layer 0's normed
    rows are in the old buffer. Logits vs the stock model, and how often each layer normalized
    its own input."""
    import dataclasses

    stock = build_model("stock", SHAPE, 3, world)
    randomize_norms_(stock, seed=12)
    woven = build_model("tokenweave", SHAPE, 3, world, config)
    woven.load_state_dict(stock.state_dict(), strict=True)
    layers = woven.decoder.layers
    layers[1].tokenweave_config = dataclasses.replace(config, max_tokens=1 << 16)
    own_norms = [0, 0, 0]
    for i, layer in enumerate(layers):
        original = layer.input_layernorm.forward

        def counted(*args, i=i, original=original):
            own_norms[i] += 1
            return original(*args)

        layer.input_layernorm.forward = counted
    tokens = torch.randint(0, SHAPE.vocab, (2, 24), generator=gen)
    errs = [rel_err(_forward(woven, tokens), _forward(stock, tokens)) for _ in range(2)]
    return dict(errs=errs, own_norms=own_norms)


@pytest.fixture(scope="module")
def model_results():
    return run_ranks(_model_worker)


def test_model_forward_over_max_tokens_raises_capacity_error(model_results):
    """TokenWeaveConfig(max_tokens=32): 33 rows (batch 3 x 11) and 34 rows (sequence parallel,
    2 shards of 17) raise WorkspaceCapacityError; exactly 32 rows (with and without sequence
    parallelism) run."""
    for results in model_results:
        for sp, rows in ((False, 33), (True, 34)):
            name, message = results[("capacity", sp, rows)]
            assert name == "WorkspaceCapacityError", (sp, rows, name, message)
            assert f"{rows} token rows" in message and f"holds {CAPACITY}" in message
        assert results[("capacity", False, 32)] == ("ok", True)
        assert results[("capacity", True, 32)] == ("ok", True)


def test_model_with_kernel_backend_on_cpu_raises_runtime_error(model_results):
    for results in model_results:
        assert results["kernel"][0] == "RuntimeError"
        assert "backend 'kernel' was requested but cannot run" in results["kernel"][1]


def test_hand_off_into_an_outgrown_workspace_is_recomputed(model_results):
    """When a layer's workspace is not the one its predecessor wrote the normed rows into, it
    waits for them and normalizes its input itself: logits still match the stock model's (the
    first forward; the second finds one workspace again and uses the hand-off)."""
    for results in model_results:
        case = results["outgrown"]
        assert all(err <= 1e-5 for err in case["errs"]), case
        assert case["own_norms"] == [2, 1, 0], case  # layer 0 always; layer 1 once


def test_python_checks_run_until_a_forward_passes_them(model_results):
    """A forward whose checks failed leaves the layer unchecked no more: the next forward
    checks again (every layer's first op), and only the one after it skips the Python checks."""
    for results in model_results:
        failed, checked, fast = results["validate"]
        assert failed == [True, "injected: the first forward's checks fail"]
        assert checked and checked[0] is True and len(checked) >= 4  # 2 layers x 2 ops
        assert fast and not any(fast)


@pytest.mark.parametrize("name", sorted(FALLBACKS))
def test_fallback_runs_stock_path(model_results, name):
    """LayerNorm, hidden 60 (not a multiple of 8) and grad-enabled forwards run the stock layer
    path at TP=2: logits identical to the stock model's, the fused op never called, and the
    reason logged."""
    for results in model_results:
        for case in results[name]:
            assert case["calls"] == 0, (name, case)
            assert case["equal"], (name, case)
        assert any(FALLBACKS[name]["reason"] in m for m in results["log"]), results["log"]
