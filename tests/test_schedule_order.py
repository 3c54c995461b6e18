"""The woven schedule's stream dependencies, checked on CPU by recording them.

The side stream is replaced by a recorder (fork/record/wait become log entries), the GEMMs and the
fused op log themselves, and the test asserts the dependencies the GPU relies on:
- a half's fused op after attention is queued right after that half's proj GEMM, on the side
  stream, and the MLP of that half waits for its event before its first GEMM;
- layer i's post-MLP op of half h is recorded on the side stream and layer i+1's qkv GEMM of half h
  waits for exactly that event (the cross-layer deferral);
- the last layer of the block adds without a norm and the current stream waits for all its
  events before the block returns;
- on the copy-engine data path (replicated layout) the side stream carries only each op's
  transfer, and its reduction runs on the main stream after the wait for that transfer, before
  the first GEMM that reads the half (never beside a GEMM);
- in a hybrid stack (one stage a layer) the same chain runs from layer to layer.

All are checked at TP=2, 4 and 8 (the parameter of the tests: one job per TP size records the
schedules); at TP=4 and 8 with the "tiny-tp8" shape, whose heads and query groups divide 8.
"""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch
from _dist import build_hybrid_model, build_model, forward, run_ranks, setup_tp

from megatron_tokenweave.config import TokenWeaveConfig
from megatron_tokenweave.models import SHAPES

LAYERS = 3
SHAPE = {2: SHAPES["tiny"], 4: SHAPES["tiny-tp8"], 8: SHAPES["tiny-tp8"]}  # by TP size
WORLDS = tuple(SHAPE)


def _record(world: int, comm: str = "fused", sp: bool = True, tokens: int = 40,
            pattern: str | None = None) -> list[tuple]:
    """The schedule of one forward of a GPTModel of LAYERS layers, or of a HybridModel of
    `pattern`, split forced."""
    import megatron_tokenweave.linears as linears_mod
    from megatron_tokenweave.communicator import Communicator
    from megatron_tokenweave.schedule import SideStream

    cfg = TokenWeaveConfig(split_threshold=0, split_align=1, comm=comm, tuning_table="none")
    if pattern is None:
        model = build_model("tokenweave_block", SHAPE[world], LAYERS, world, cfg,
                            sequence_parallel=sp)
    else:
        model = build_hybrid_model("tokenweave", SHAPE[world], pattern, world, cfg,
                                   sequence_parallel=sp)
    names = {p.data_ptr(): n for n, p in model.named_parameters()}
    log: list[tuple] = []
    counter = itertools.count()
    state = {"side": False}

    @contextlib.contextmanager
    def run(self):
        state["side"] = True
        try:
            yield
        finally:
            state["side"] = False

    def record(self):
        event = f"e{next(counter)}"
        log.append(("record", event))
        return event

    def wait(event):
        if event is not None:
            log.append(("wait", event))

    def gemm(x, weight, out, original=linears_mod.gemm_into):
        log.append(("gemm", names[weight.data_ptr()], out.shape[1]))
        return original(x, weight, out)

    def fused(self, partial, residual, weight, *args, original=Communicator.allreduce_rmsnorm,
              **kwargs):
        stream = "side" if state["side"] else "main"
        touched = [residual, args[1]] + ([args[2]] if isinstance(args[2], torch.Tensor) else [])
        log.append(("fused", stream, weight is None, partial.shape[1],
                    kwargs.get("phase", "whole"), {_storage(t) for t in touched}))
        return original(self, partial, residual, weight, *args, **kwargs)

    patches = [
        (SideStream, "run", run), (SideStream, "record", record),
        (SideStream, "wait", staticmethod(wait)), (linears_mod, "gemm_into", gemm),
        (Communicator, "allreduce_rmsnorm", fused),
    ]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    original_init = SideStream.__init__

    def init(self, device):
        original_init(self, device)
        self.enabled = True  # take the GPU code path; the recorder stands in for CUDA

    patches.append((SideStream, "__init__", init))
    saved.append((SideStream, "__init__", original_init))
    for obj, name, value in patches:
        setattr(obj, name, value)
    try:
        for i, layer in enumerate(model.decoder.layers):
            layer.register_forward_pre_hook(lambda *_, i=i: log.append(("begin", i)))
            layer.register_forward_hook(lambda layer, *_, i=i: log.append(
                ("held", _held(layer._chain.pending))))
            layer.register_forward_hook(lambda *_, i=i: log.append(("end", i)))
        forward(model, torch.randint(0, SHAPE[world].vocab, (1, tokens)))
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)
    return log


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _held(handoff) -> set[int]:
    """The storages a layer's hand-off keeps alive for its pending ops."""
    if handoff is None:
        return set()
    return {_storage(t) for t in (handoff.residual, handoff.normed, *handoff.reads)}


HYBRID = "*-*-"


def _record_all(rank: int, world: int) -> tuple[list[tuple], list[tuple], list[tuple]]:
    """The schedules the tests read, recorded in one job: the fused op with sequence
    parallelism (40 tokens: halves of 20 / world rows a shard), the copy-engine data path,
    replicated (41 tokens: halves of 20 and 21 rows at every TP size), and the hybrid stack
    HYBRID with sequence parallelism."""
    setup_tp(world)
    return (_record(world), _record(world, "copy_engine", False, 41),
            _record(world, pattern=HYBRID))


@pytest.fixture(scope="module", params=WORLDS, ids=[f"tp{w}" for w in WORLDS])
def logs(request) -> tuple[list[tuple], list[tuple], list[tuple]]:
    """Rank 0's recordings at TP=param."""
    return run_ranks(_record_all, world=request.param)[0]


def _split_layers(log):
    layers, current = [], None
    for entry in log:
        if entry[0] == "begin":
            current = []
        elif entry[0] == "end":
            layers.append(current)
            current = None
        elif current is not None:
            current.append(entry)
    return layers


def test_stream_dependencies_of_the_woven_schedule(logs):
    log = logs[0]
    layers = _split_layers(log)
    assert len(layers) == LAYERS
    handed_off: list[str] | None = None
    for index, entries in enumerate(layers):
        last = index == LAYERS - 1
        fused = [i for i, e in enumerate(entries) if e[0] == "fused"]
        assert len(fused) == 4, entries  # attention A, B; MLP A, B
        assert all(entries[i][1] == "side" for i in fused)
        events = [entries[i + 1][1] for i in fused]  # each op is followed by its event
        assert all(entries[i + 1][0] == "record" for i in fused)
        attn_events, mlp_events = events[:2], events[2:]
        gemms = [(i, e[1]) for i, e in enumerate(entries) if e[0] == "gemm"]

        def first(kind, after=-1, entries=entries, gemms=gemms):
            return next(i for i, name in gemms if kind in name and i > after)

        # qkv of each half waits for the previous layer's post-MLP event of that half.
        qkv = [i for i, name in gemms if "linear_qkv" in name]
        assert len(qkv) == 2
        if handed_off is not None:
            for half, gemm_at in enumerate(qkv):
                waits = [e[1] for e in entries[:gemm_at] if e[0] == "wait"]
                assert handed_off[half] in waits, (index, half, entries)
        # a half's attention op is queued right after that half's proj GEMM.
        proj = [i for i, name in gemms if "linear_proj" in name]
        assert [entries[i + 1][0] for i in proj] == ["fused", "fused"]
        # the MLP of a half waits for that half's attention event before its first GEMM.
        for half in range(2):
            fc1_at = first("linear_fc1", after=proj[-1] if half == 0 else first("linear_fc2"))
            waits = [e[1] for e in entries[:fc1_at] if e[0] == "wait"]
            assert attn_events[half] in waits, (index, half, entries)
        # post-MLP ops normalize with the next layer's weight; the last layer only adds.
        assert [entries[i][2] for i in fused[2:]] == [last, last]
        if last:
            tail_waits = [e[1] for e in entries[fused[-1]:] if e[0] == "wait"]
            assert set(mlp_events) <= set(tail_waits), entries
        handed_off = mlp_events


def test_copy_engine_reduction_runs_on_the_main_stream_before_its_consumer(logs):
    # 41 tokens, replicated: halves of 20 and 21 rows, so every op names its half by its rows.
    log = logs[1]
    layers = _split_layers(log)
    assert len(layers) == LAYERS
    rows = (20, 21)
    handed_off: list[str] | None = None  # the previous layer's post-MLP transfer events (A, B)
    for index, entries in enumerate(layers):
        last = index == LAYERS - 1
        fused = [(i, e) for i, e in enumerate(entries) if e[0] == "fused"]
        assert not [e for _, e in fused if e[4] == "whole"], entries
        transfers = [i for i, e in fused if e[4] == "transfer"]
        reduces = [i for i, e in fused if e[4] == "reduce"]
        assert all(entries[i][1] == "side" for i in transfers), entries
        assert all(entries[i][1] == "main" for i in reduces), entries
        assert [entries[i][3] for i in transfers] == list(rows) * 2, entries  # attn A B, MLP A B
        assert all(entries[i + 1][0] == "record" for i in transfers), entries
        events = [entries[i + 1][1] for i in transfers]
        gemms = [i for i, e in enumerate(entries) if e[0] == "gemm"]
        qkv = [i for i in gemms if "linear_qkv" in entries[i][1]]
        proj = [i for i in gemms if "linear_proj" in entries[i][1]]
        fc1 = [i for i in gemms if "linear_fc1" in entries[i][1]]
        assert [entries[i + 1][0] for i in proj] == ["fused", "fused"], entries

        def reduce_before(consumer: int, half: int, event: str, entries=entries,
                          reduces=reduces, gemms=gemms, index=index) -> int:
            """The half's reduction: after the wait for its transfer's event, before the GEMM
            that reads the half, with no GEMM between the wait and the reduction."""
            at = max(i for i in reduces if i < consumer and entries[i][3] == rows[half])
            wait_at = entries.index(("wait", event))
            assert wait_at < at < consumer, (index, half, entries)
            assert not [g for g in gemms if wait_at < g < at], (index, half, entries)
            return at

        # The previous layer's post-MLP reductions run here, each before this layer's qkv GEMM
        # of its half.
        if handed_off is not None:
            for half in range(2):
                reduce_before(qkv[half], half, handed_off[half])
        # Attention: each half's reduction after both proj GEMMs, before the half's MLP.
        for half in range(2):
            assert reduce_before(fc1[half], half, events[half]) > proj[-1], entries
        # Post-MLP: deferred to the next layer, except the last layer's, reduced before it ends.
        mlp_reduces = [i for i in reduces if i > transfers[3]]
        if last:
            assert [entries[i][3] for i in mlp_reduces] == list(rows), entries
            for half in range(2):
                wait_at = entries.index(("wait", events[2 + half]))
                assert wait_at < mlp_reduces[half], entries
        else:
            assert not mlp_reduces, entries
        assert len(reduces) == (2 if index else 0) + 2 + (2 if last else 0), entries
        handed_off = events[2:]


def test_the_chain_runs_across_hybrid_layers(logs):
    """A hybrid stack `*-*-` (one stage a layer): each layer queues one fused op per half on the
    side stream, right after that half's row-parallel GEMM (linear_proj, linear_fc2), each
    followed by its event; the next layer's first GEMM of a half (linear_qkv, linear_fc1) is
    issued right after waiting for that half's event of the layer before; every op but the last
    layer's applies a norm, and the stack's last layer joins its events before it returns."""
    layers = _split_layers(logs[2])
    assert len(layers) == len(HYBRID)
    handed_off: list[str] | None = None
    for index, (symbol, entries) in enumerate(zip(HYBRID, layers, strict=True)):
        last = index == len(HYBRID) - 1
        column, row = ("linear_qkv", "linear_proj") if symbol == "*" else ("linear_fc1",
                                                                            "linear_fc2")
        fused = [i for i, e in enumerate(entries) if e[0] == "fused"]
        assert len(fused) == 2 and all(entries[i][1] == "side" for i in fused), entries
        assert [entries[i][2] for i in fused] == [last, last], entries  # add only at the end
        assert all(entries[i + 1][0] == "record" for i in fused), entries
        events = [entries[i + 1][1] for i in fused]
        gemms = [(i, e[1]) for i, e in enumerate(entries) if e[0] == "gemm"]
        firsts = [i for i, name in gemms if column in name]
        rows = [i for i, name in gemms if row in name]
        assert len(firsts) == len(rows) == 2, entries
        assert [entries[i + 1][0] for i in rows] == ["fused", "fused"], entries
        if handed_off is not None:
            for half, gemm_at in enumerate(firsts):
                waits = [e[1] for e in entries[:gemm_at] if e[0] == "wait"]
                assert waits and waits[-1] == handed_off[half], (index, half, entries)
        if last:
            tail_waits = [e[1] for e in entries[fused[-1]:] if e[0] == "wait"]
            assert set(events) <= set(tail_waits), entries
        handed_off = events


@pytest.mark.parametrize("which", [0, 2], ids=["gpt", "hybrid"])
def test_a_handed_off_op_reads_only_what_the_hand_off_keeps(logs, which):
    """Every tensor a layer's last ops read or write while the successor has not yet waited for
    them (the ops whose events cross the layer's end) is kept alive by the layer's hand-off:
    the caller frees a layer's input when it returns, and memory the caching allocator hands
    to the successor's main-stream work must not be what a pending side-stream op reads (a
    one-stage hybrid layer's op adds the layer's input)."""
    layers = _split_layers(logs[which])
    for index, entries in enumerate(layers[:-1]):
        fused = [e for e in entries if e[0] == "fused"]
        crossing = fused[-2:]  # the last stage's two halves: their events cross the layer's end
        held = next(e[1] for e in entries if e[0] == "held")
        for entry in crossing:
            assert entry[5] <= held, (index, entry, held)
