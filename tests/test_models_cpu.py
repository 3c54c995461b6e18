"""More model families on the reference path (gloo, TP=2 and 4): Qwen2.5-style attention with QKV
bias (tied and untied embeddings, sequence parallelism on and off) and Mixtral-style MoE layers.
At TP=4 the "tiny-tp8" shape (its heads and query groups divide 4) and sequence lengths divisible
by 4 with odd rows a shard."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _dist import (
    build_model,
    forward,
    randomize_norms_,
    record_fused_calls,
    rel_err,
    run_ranks,
    same_router_on_every_rank_,
    setup_tp,
)

from megatron_tokenweave.config import TokenWeaveConfig
from megatron_tokenweave.models import MOE_DISPATCH, SHAPES

SPLIT = TokenWeaveConfig(split_threshold=0, split_align=1, tuning_table="none")
LAYERS = 2
TINY = {2: SHAPES["tiny"], 4: SHAPES["tiny-tp8"]}  # by TP size
WORLDS = tuple(TINY)
# (batch, tokens) by TP size; with sequence parallelism rows a shard: 51 / 27 (Qwen), 18 / 14 (MoE)
QWEN_TOKENS = {2: (3, 34), 4: (3, 36)}
MOE_TOKENS = {2: (2, 18), 4: (2, 28)}


def _compare(shape, world: int, sp: bool, tokens: torch.Tensor, prepare=None, **kwargs):
    """Stock local model vs tokenweave model (same weights): (rel. error, fused-op calls)."""
    stock = build_model("stock", shape, LAYERS, world, **kwargs)
    randomize_norms_(stock, seed=3)
    if prepare is not None:
        prepare(stock)
    kind = "tokenweave_block" if sp else "tokenweave"
    tw = build_model(kind, shape, LAYERS, world, SPLIT, sequence_parallel=sp, **kwargs)
    tw.load_state_dict(stock.state_dict(), strict=True)
    want = forward(stock, tokens)
    with record_fused_calls() as calls:
        got = forward(tw, tokens)
    return rel_err(got, want), len(calls)


def _random_qkv_bias_(rank: int):
    def prepare(model: torch.nn.Module) -> None:
        """QKV biases start at zero: make them matter (TP-sharded, so per rank)."""
        gen = torch.Generator().manual_seed(rank + 10)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("linear_qkv.bias"):
                    param.copy_(torch.randn(param.shape, generator=gen))

    return prepare


def _qwen(rank: int, world: int) -> list[tuple]:
    setup_tp(world)
    tokens = torch.randint(0, TINY[world].vocab, QWEN_TOKENS[world],
                           generator=torch.Generator().manual_seed(5))
    return [
        (tied, sp, *_compare(TINY[world], world, sp, tokens, _random_qkv_bias_(rank),
                             tied=tied, add_qkv_bias=True))
        for tied in (False, True)
        for sp in (False, True)
    ]


@pytest.mark.parametrize("world", WORLDS, ids=[f"tp{w}" for w in WORLDS])
def test_qwen_qkv_bias_matches_stock(world):
    for tied, sp, err, calls in run_ranks(_qwen, world=world)[0]:
        case = f"tied={tied} sp={sp}"
        assert err <= 1e-5, f"{case}: rel error {err}"
        assert calls == 2 * 2 * LAYERS, f"{case}: fused op ran {calls} times"


def _moe(rank: int, world: int) -> list[tuple]:
    setup_tp(world)
    shape = dataclasses.replace(TINY[world], experts=4, topk=2, ffn=96)
    tokens = torch.randint(0, shape.vocab, MOE_TOKENS[world],
                           generator=torch.Generator().manual_seed(6))
    return [
        (dispatch, sp, *_compare(shape, world, sp, tokens, same_router_on_every_rank_,
                                 spec_kwargs={"num_experts": 4}, moe_dispatch=dispatch))
        for dispatch in MOE_DISPATCH
        for sp in (False, True)
    ]


@pytest.mark.parametrize("world", WORLDS, ids=[f"tp{w}" for w in WORLDS])
def test_moe_dispatchers_are_woven(world):
    """Mixtral-style MoE with the all-gather dispatcher (dropless) and the all-to-all dispatcher
    padded to a capacity that drops nothing (the CUDA-graph capturable one): the expert output's
    reduction is the fused op (two per layer per half) and the logits match the stock spec
    (whose dispatcher does its own TP all-gather / reduce-scatter)."""
    results = run_ranks(_moe, world=world)[0]
    assert {r[0] for r in results} == set(MOE_DISPATCH)
    for dispatcher, sp, err, calls in results:
        case = f"dispatcher={dispatcher} sp={sp}"
        assert err <= 1e-5, f"{case}: rel error {err}"
        assert calls == 2 * 2 * LAYERS, f"{case}: fused op ran {calls} times"


def test_moe_policy_names_what_it_cannot_weave():
    from types import SimpleNamespace

    from megatron.core.transformer.moe.token_dispatcher import (
        MoEAllGatherTokenDispatcher,
        MoEAlltoAllTokenDispatcher,
    )

    from megatron_tokenweave import moe

    config = SimpleNamespace(moe_expert_capacity_factor=None, moe_latent_size=None,
                             moe_pad_expert_input_to_capacity=False, num_moe_experts=8,
                             moe_router_topk=2, expert_tensor_parallel_size=None,
                             tensor_model_parallel_size=2)

    def layer(dispatcher, **changes):
        return SimpleNamespace(config=SimpleNamespace(**{**vars(config), **changes}),
                               token_dispatcher=dispatcher, use_shared_expert=False)

    allgather = object.__new__(MoEAllGatherTokenDispatcher)
    alltoall = object.__new__(MoEAlltoAllTokenDispatcher)
    unpadded = object.__new__(MoEAlltoAllTokenDispatcher)
    allgather.ep_size = alltoall.ep_size = unpadded.ep_size = 1
    alltoall.drop_and_pad, unpadded.drop_and_pad = True, False  # what the dispatcher was built as
    padded = dict(moe_pad_expert_input_to_capacity=True, moe_expert_capacity_factor=4.0)
    assert moe.unsupported_reason(layer(allgather)) is None
    assert moe.unsupported_reason(layer(alltoall, **padded)) is None
    # capacity >= every token an expert can get (factor >= experts / top-k): nothing dropped
    assert moe.unsupported_reason(layer(allgather, moe_expert_capacity_factor=4.0)) is None
    assert "dispatcher" in moe.unsupported_reason(layer(SimpleNamespace(ep_size=1)))
    assert "drop-and-pad" in moe.unsupported_reason(layer(unpadded, **padded))
    for dispatcher in (allgather, alltoall):
        reason = moe.unsupported_reason(layer(dispatcher, **{**padded,
                                                             "moe_expert_capacity_factor": 3.9}))
        assert "drops tokens" in reason and "experts / top-k = 4" in reason
    assert "expert tensor" in moe.unsupported_reason(layer(allgather,
                                                           expert_tensor_parallel_size=1))
    allgather.ep_size = 2
    assert "expert parallelism" in moe.unsupported_reason(layer(allgather))


def test_the_layer_checks_its_structure_once_and_the_experts_padding_every_call():
    """Megatron's engines switch the experts' padding (dispatcher drop-and-pad, capacity factor)
    between prefill and decode steps: the layer must ask the MoE layer on every call, while its
    configuration and module types are checked once."""
    from types import SimpleNamespace

    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    from megatron_tokenweave import layer as layer_module
    from megatron_tokenweave.stages import MixerStage

    Layer = layer_module.TokenWeaveTransformerLayer
    dispatcher = object.__new__(MoEAlltoAllTokenDispatcher)
    dispatcher.ep_size, dispatcher.drop_and_pad = 1, False
    config = SimpleNamespace(moe_expert_capacity_factor=4.0, moe_latent_size=None,
                             moe_pad_expert_input_to_capacity=True, num_moe_experts=8,
                             moe_router_topk=2, expert_tensor_parallel_size=None,
                             tensor_model_parallel_size=2)
    mlp = SimpleNamespace(config=config, token_dispatcher=dispatcher, use_shared_expert=False)
    checks = []
    stages = (MixerStage("moe", "pre_mlp_layernorm", mlp, None, None),)
    fake = SimpleNamespace(_tp=(2, 0), mlp=mlp, _stages=lambda: stages,
                           _check_structure=lambda: checks.append(1),  # returns None: fine
                           _fp8_now=lambda: False)
    fake._structure_reason = lambda: Layer._structure_reason(fake)
    x = torch.zeros(3, 1, 16, dtype=torch.bfloat16)
    with torch.no_grad():
        assert "drop-and-pad" in Layer._unsupported_reason(fake, x)  # a prefill step, unpadded
        dispatcher.drop_and_pad = True  # a decode step with padded experts
        assert Layer._unsupported_reason(fake, x) is None
        dispatcher.drop_and_pad = False
        assert "drop-and-pad" in Layer._unsupported_reason(fake, x)
    assert len(checks) == 1, "the structure is checked once"


def test_moe_capacity_must_hold_every_token_of_every_call():
    """Megatron's own capacity rule decides per call (each half of a split is a call): the padded
    dispatcher needs exactly one slot per token, the all-gather one at least one; else a clear
    error before anything is launched."""
    from types import SimpleNamespace

    import pytest
    from megatron.core.transformer.moe.token_dispatcher import (
        MoEAllGatherTokenDispatcher,
        MoEAlltoAllTokenDispatcher,
    )

    from megatron_tokenweave import moe
    from megatron_tokenweave.ops.validate import TokenWeaveInputError

    alltoall = object.__new__(MoEAlltoAllTokenDispatcher)
    alltoall.drop_and_pad = True
    allgather = object.__new__(MoEAllGatherTokenDispatcher)

    def layer(dispatcher, experts, topk, factor):
        config = SimpleNamespace(num_moe_experts=experts, moe_router_topk=topk,
                                 moe_expert_capacity_factor=factor)
        return SimpleNamespace(config=config, token_dispatcher=dispatcher)

    counts = [1, 7, 31, 512, 4097]
    for dispatcher in (alltoall, allgather):
        moe.check_capacity(layer(dispatcher, 8, 2, 4.0), counts)  # Mixtral: exact
        moe.check_capacity(layer(dispatcher, 8, 2, None), counts)  # dropless
    moe.check_capacity(layer(allgather, 8, 2, 4.5), counts)  # more slots than tokens: fine
    with pytest.raises(TokenWeaveInputError, match="exactly one slot per token"):
        moe.check_capacity(layer(alltoall, 8, 2, 4.5), [512])
    # 60 experts, top-4, factor 15: float rounding gives 32 slots for 31 tokens
    with pytest.raises(TokenWeaveInputError, match="capacity 32 .* for 31 tokens"):
        moe.check_capacity(layer(alltoall, 60, 4, 15.0), [31])
    with pytest.raises(TokenWeaveInputError, match="at least one slot"):
        moe.check_capacity(layer(allgather, 8, 2, 2.0), [512])
