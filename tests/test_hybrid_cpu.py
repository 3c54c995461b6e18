"""HybridModel with the TokenWeave hybrid stack spec vs the stock hybrid stack, on gloo ranks
(fp32, TP 2 and 4).

Megatron's hybrid_stack_spec is TE-only, so the stock side here is its local-module form
(`hybrid.local_hybrid_stack_spec`: Megatron's layer classes on its LocalSpecProvider's modules).
That stock side is itself checked against Megatron's GPTModel with its own local spec: the
pattern `*-*-` is the decoder of a 2-layer GPTModel, and with the same weights the two models
give the same logits (`test_local_hybrid_stack_is_megatrons_gpt_decoder`).

Patterns `*-*-*-` (dense) and `*E*E` (MoE, the all-gather dispatcher), sequence parallelism off
and on (the stock side without it: same math, its local final norm refuses it), odd token
counts, every mechanism: the fused op (the reference on gloo), collectives, the copy-engine
schedule, the GEMM-fused emulation, unsplit and split (forced at the midpoint, and aligned). The
woven stack loads the stock state dict strictly and the stock one loads the woven one.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _dist import (
    build_hybrid_model,
    build_model,
    forward,
    randomize_norms_,
    record_fused_calls,
    record_norms,
    rel_err,
    run_ranks,
    same_router_on_every_rank_,
    setup_tp,
)

from megatron_tokenweave.config import TokenWeaveConfig
from megatron_tokenweave.models import SHAPES, pattern_layers

TINY = {2: SHAPES["tiny"], 4: SHAPES["tiny-tp8"]}  # by TP size
WORLDS = tuple(TINY)
PATTERNS = {"dense": "*-*-*-", "moe": "*E*E"}
SPLITS = {
    "forced": TokenWeaveConfig(split_threshold=0, split_align=1, tuning_table="none"),
    "aligned": TokenWeaveConfig(split_threshold=0, split_align=16, split_offset=2,
                                tuning_table="none"),
    "none": TokenWeaveConfig(split_threshold=10**9, tuning_table="none"),
    "collectives": TokenWeaveConfig(split_threshold=0, split_align=1, comm="collectives",
                                    tuning_table="none"),
    "copy_engine": TokenWeaveConfig(split_threshold=0, split_align=1, comm="copy_engine",
                                    tuning_table="none"),
    "gemm": TokenWeaveConfig(split_threshold=0, split_align=1, comm="gemm", tuning_table="none"),
}
# (tokens, batch) by TP size; sequence parallelism runs the counts the TP size divides.
CASES = {2: ((7, 1), (38, 3), (64, 1)), 4: ((9, 1), (36, 3))}


def _shape(world: int, kind: str):
    if kind == "moe":
        return dataclasses.replace(TINY[world], experts=4, topk=2, ffn=96)
    return TINY[world]


def _parity_worker(rank: int, world: int) -> dict:
    setup_tp(world)
    gen = torch.Generator().manual_seed(3)  # the same tokens on every rank
    results: dict = {}
    for kind, pattern in PATTERNS.items():
        shape = _shape(world, kind)
        stock = build_hybrid_model("stock", shape, pattern, world)
        randomize_norms_(stock, seed=11)
        same_router_on_every_rank_(stock)
        state = stock.state_dict()
        cases = [(torch.randint(0, shape.vocab, (b, t), generator=gen), t, b)
                 for t, b in CASES[world]]
        wants = [forward(stock, tokens) for tokens, _, _ in cases]
        for sp in (False, True):
            for split, cfg in SPLITS.items():
                woven = build_hybrid_model("tokenweave", shape, pattern, world, cfg,
                                           sequence_parallel=sp)
                woven.load_state_dict(state, strict=True)
                norms = [layer.first_norm().weight.data_ptr() for layer in woven.decoder.layers]
                for (tokens, t, b), want in zip(cases, wants, strict=True):
                    if sp and t % world:
                        continue
                    with record_fused_calls() as calls, record_norms() as weights:
                        got = forward(woven, tokens)
                    results[(kind, sp, split, t, b)] = dict(
                        err=rel_err(got, want), finite=bool(torch.isfinite(got).all()),
                        calls=list(calls), weights=list(weights), norms=norms)
    return results


@pytest.fixture(scope="module", params=WORLDS, ids=[f"tp{w}" for w in WORLDS])
def per_rank(request) -> list[dict]:
    return run_ranks(_parity_worker, world=request.param)


def test_every_case_ran(per_rank):
    world = len(per_rank)
    want = {(k, sp, s, t, b) for k in PATTERNS for sp in (False, True) for s in SPLITS
            for t, b in CASES[world] if not (sp and t % world)}
    for results in per_rank:
        assert set(results) == want


def test_hybrid_logits_match_the_stock_hybrid_stack(per_rank):
    """Logits within rel 1e-5 of the stock hybrid stack's, every pattern, layout, mechanism and
    token count."""
    bad = [(rank, key, case["err"]) for rank, results in enumerate(per_rank)
           for key, case in sorted(results.items())
           if not (case["finite"] and case["err"] <= 1e-5)]
    assert not bad, bad


def test_each_hybrid_layer_is_one_stage_whose_op_normalizes_for_the_next_layer(per_rank):
    """A hybrid layer is one stage: one fused op per half per layer, over every row of every
    chunk; layer i's ops apply layer i+1's first norm (the chain across layers) and the last
    layer's ops add only (the stack's final norm follows)."""
    world = len(per_rank)
    for rank, results in enumerate(per_rank):
        for (kind, sp, split, t, b), case in results.items():
            layers = pattern_layers(PATTERNS[kind])
            rows = (t // world if sp else t) * b
            halves = 1 if split == "none" or rows < 2 else 2
            where = (rank, kind, sp, split, t, b)
            calls, weights, norms = case["calls"], case["weights"], case["norms"]
            assert len(calls) == layers * halves, where
            assert all(chunks == (world if sp else 1) for chunks, _ in calls), where
            for i in range(layers):
                mine = calls[i * halves:(i + 1) * halves]
                assert sum(r for _, r in mine) == rows, where
                want = norms[i + 1] if i + 1 < layers else None
                assert [w for w, _ in weights[i * halves:(i + 1) * halves]] == [want] * halves, \
                    where


def test_every_op_of_a_forward_is_a_call_of_its_own_and_the_same_on_every_rank(per_rank):
    """The call numbers the kernels check (layer, stage and half): distinct within a forward,
    the same list on every rank."""
    for key in per_rank[0]:
        numbers = [[c for _, c in results[key]["weights"]] for results in per_rank]
        assert all(isinstance(c, int) for c in numbers[0]), (key, numbers[0])
        assert len(set(numbers[0])) == len(numbers[0]), (key, numbers[0])
        assert all(n == numbers[0] for n in numbers), key


def _anchor_worker(rank: int, world: int) -> dict:
    """Megatron's GPTModel (local spec, 2 layers) against the local hybrid stack `*-*-` and the
    woven hybrid stack with the GPT model's weights (GPT layer i = hybrid layers 2i, 2i + 1:
    hybrid.gpt_to_hybrid_state_dict)."""
    from megatron_tokenweave.hybrid import gpt_to_hybrid_state_dict

    setup_tp(world)
    shape = TINY[world]
    gpt = build_model("stock", shape, 2, world)
    randomize_norms_(gpt, seed=7)
    mapped = gpt_to_hybrid_state_dict(gpt.state_dict())
    tokens = torch.randint(0, shape.vocab, (3, 21), generator=torch.Generator().manual_seed(2))
    want = forward(gpt, tokens)
    errs = {}
    for kind in ("stock", "tokenweave"):
        cfg = SPLITS["forced"] if kind == "tokenweave" else None
        hybrid = build_hybrid_model(kind, shape, "*-*-", world, cfg)
        hybrid.load_state_dict(mapped, strict=True)
        errs[kind] = rel_err(forward(hybrid, tokens), want)
    return errs


def test_local_hybrid_stack_is_megatrons_gpt_decoder():
    """The stock side of these tests is trustworthy: with a 2-layer GPTModel's weights (Megatron's
    local spec, unchanged), the local hybrid stack `*-*-` gives the GPT model's logits, and so
    does the woven one (split forced)."""
    for errs in run_ranks(_anchor_worker, world=2):
        assert errs["stock"] <= 1e-6, errs
        assert errs["tokenweave"] <= 1e-5, errs


def _checkpoint_keys_worker(rank: int, world: int) -> dict:
    setup_tp(world)
    out = {}
    for kind, pattern in PATTERNS.items():
        shape = _shape(world, kind)
        stock = build_hybrid_model("stock", shape, pattern, world)
        woven = build_hybrid_model("tokenweave", shape, pattern, world, SPLITS["forced"])
        randomize_norms_(woven, seed=1)
        stock.load_state_dict(woven.state_dict(), strict=True)  # woven -> stock
        same = all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
                   for a, b in zip(stock.state_dict().values(), woven.state_dict().values(),
                                   strict=True))

        def sharded(model):  # checkpoint key -> (global shape, global offset)
            return {v.key: (tuple(v.global_shape), tuple(v.global_offset))
                    for v in model.sharded_state_dict().values() if hasattr(v, "global_shape")}

        out[kind] = dict(keys=(list(stock.state_dict()), list(woven.state_dict())), same=same,
                         sharded=(sharded(stock), sharded(woven)))
    return out


def test_hybrid_checkpoint_keys_and_sharding_are_the_stock_stacks():
    """The same state-dict keys (in order), loads both ways with strict=True, and the same
    sharded state dict: checkpoint keys, global shapes and offsets (norms under the fused
    linears' names, as TE checkpoints have them)."""
    for rank, out in enumerate(run_ranks(_checkpoint_keys_worker, world=2)):
        for kind, case in out.items():
            stock_keys, woven_keys = case["keys"]
            assert stock_keys == woven_keys, (rank, kind)
            assert case["same"], (rank, kind)
            stock_sharded, woven_sharded = case["sharded"]
            assert stock_sharded == woven_sharded, (rank, kind)
            assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in woven_sharded


class CausalConvMixer(torch.nn.Module):
    """A sequence mixer with Megatron's Mamba mixer interface (built by MambaLayer from a spec
    with in_proj / out_proj submodules; returns (output, bias)) and, like Mamba's scan, output
    rows that depend on earlier rows: in_proj -> (z, x), a causal depthwise convolution of x
    along the sequence, gated by silu(z), out_proj. The real MambaMixer needs mamba-ssm's
    Triton kernels, which do not run on a CPU; this checks the woven MambaLayer around it
    (its norm, in_proj / out_proj per half, the core on all rows)."""

    WIDTH = 4

    def __init__(self, config, submodules, d_model, layer_number=1, pg_collection=None,
                 pp_layer_offset=0, name=None):
        from megatron.core.transformer.spec_utils import build_module

        super().__init__()
        inner = 2 * d_model
        tp = pg_collection.tp
        self.in_proj = build_module(
            submodules.in_proj, d_model, 2 * inner, config=config,
            init_method=config.init_method, gather_output=False, bias=False, skip_bias_add=False,
            is_expert=False, tp_comm_buffer_name="fc1", tp_group=tp)
        local = inner // tp.size()
        self.conv = torch.nn.Parameter(torch.randn(local, 1, self.WIDTH) / self.WIDTH)
        self.out_proj = build_module(
            submodules.out_proj, inner, d_model, config=config,
            init_method=config.output_layer_init_method, bias=False, input_is_parallel=True,
            skip_bias_add=True, is_expert=False, tp_comm_buffer_name="fc2", tp_group=tp)

    def forward(self, hidden_states, inference_context=None, packed_seq_params=None):
        zx, _ = self.in_proj(hidden_states)
        z, x = zx.chunk(2, dim=-1)
        seq = x.shape[0]
        mixed = torch.nn.functional.conv1d(x.permute(1, 2, 0), self.conv,
                                           padding=self.WIDTH - 1, groups=x.shape[-1])
        y = mixed[..., :seq].permute(2, 0, 1) * torch.nn.functional.silu(z)
        return self.out_proj(y.contiguous())


def _with_stand_in_mixer(spec):
    sub = spec.submodules
    mamba = sub.mamba_layer
    mixer = dataclasses.replace(mamba.submodules.mixer, module=CausalConvMixer)
    mamba = dataclasses.replace(mamba, submodules=dataclasses.replace(mamba.submodules,
                                                                     mixer=mixer))
    return dataclasses.replace(spec, submodules=dataclasses.replace(sub, mamba_layer=mamba))


MAMBA_PATTERN = "M*M-"


def _mamba_worker(rank: int, world: int) -> dict:
    from megatron_tokenweave.hybrid import get_hybrid_stack_tokenweave_spec, local_hybrid_stack_spec

    setup_tp(world)
    shape = TINY[world]
    stock = build_hybrid_model("stock", shape, MAMBA_PATTERN, world,
                               spec=_with_stand_in_mixer(local_hybrid_stack_spec()))
    randomize_norms_(stock, seed=4)
    gen = torch.Generator().manual_seed(8)
    out = {}
    for sp in (False, True):
        for split in ("forced", "none", "gemm"):
            spec = _with_stand_in_mixer(get_hybrid_stack_tokenweave_spec(False, SPLITS[split]))
            woven = build_hybrid_model("tokenweave", shape, MAMBA_PATTERN, world, spec=spec,
                                       sequence_parallel=sp)
            woven.load_state_dict(stock.state_dict(), strict=True)
            for t, b in ((38, 3), (7, 1)):
                if sp and t % world:
                    continue
                tokens = torch.randint(0, shape.vocab, (b, t), generator=gen)
                want = forward(stock, tokens)
                with record_fused_calls() as calls:
                    got = forward(woven, tokens)
                types = [type(m).__name__ for m in woven.decoder.layers]
                out[(sp, split, t, b)] = dict(err=rel_err(got, want), calls=len(calls),
                                              types=types)
    return out


def test_woven_mamba_layer_around_a_sequence_mixer():
    """'M' layers (MambaLayer) weave like attention: their norm applied by the layer before's
    fused op, in_proj and out_proj per half, the mixer's core on all rows (its rows depend on
    earlier ones); logits equal the stock stack's, split or not, both layouts, one fused op per
    half per layer."""
    for rank, out in enumerate(run_ranks(_mamba_worker, world=2)):
        assert len(out) == 9, out.keys()
        for (sp, split, t, b), case in out.items():
            where = (rank, sp, split, t, b, case)
            assert case["types"][0] == "TokenWeaveMambaLayer", where
            assert case["err"] <= 1e-5, where
            rows = (t // 2 if sp else t) * b
            assert case["calls"] == len(MAMBA_PATTERN) * (1 if split == "none" or rows < 2
                                                          else 2), where
