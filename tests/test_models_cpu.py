"""More model families on the reference path (gloo, TP=2): Qwen2.5-style attention with QKV bias
(tied and untied embeddings, sequence parallelism on and off) and Mixtral-style MoE layers."""

from __future__ import annotations

import torch
from _dist import (
    build_model,
    forward,
    randomize_norms_,
    record_fused_calls,
    rel_err,
    run_ranks,
    setup_tp,
)

from megatron_tokenweave.config import TokenWeaveConfig
from megatron_tokenweave.models import SHAPES

SPLIT = TokenWeaveConfig(split_threshold=0, split_align=1, tuning_table="none")
LAYERS = 2


def _qwen(rank: int, world: int) -> list[tuple]:
    setup_tp(world)
    shape = SHAPES["tiny"]
    results = []
    for tied in (False, True):
        for sp in (False, True):
            stock = build_model("stock", shape, LAYERS, world, tied=tied, add_qkv_bias=True)
            randomize_norms_(stock, seed=3)
            with torch.no_grad():  # QKV biases start at zero: make them matter
                for name, param in stock.named_parameters():
                    if name.endswith("linear_qkv.bias"):
                        param.copy_(torch.randn(param.shape, generator=torch.Generator()
                                                .manual_seed(rank + 10)))
            kind = "tokenweave_block" if sp else "tokenweave"
            tw = build_model(kind, shape, LAYERS, world, SPLIT, tied=tied, add_qkv_bias=True,
                             sequence_parallel=sp)
            tw.load_state_dict(stock.state_dict(), strict=True)
            tokens = torch.randint(0, shape.vocab, (3, 34), generator=torch.Generator()
                                   .manual_seed(5))
            want = forward(stock, tokens)
            with record_fused_calls() as calls:
                got = forward(tw, tokens)
            results.append((tied, sp, rel_err(got, want), len(calls)))
    return results


def test_qwen_qkv_bias_matches_stock():
    for tied, sp, err, calls in run_ranks(_qwen)[0]:
        case = f"tied={tied} sp={sp}"
        assert err <= 1e-5, f"{case}: rel error {err}"
        assert calls == 2 * 2 * LAYERS, f"{case}: fused op ran {calls} times"


def _same_router_on_every_rank_(model: torch.nn.Module) -> None:
    """Router weights are replicated across TP ranks in any checkpoint; Megatron's random CPU init
    draws them per rank, so make them equal as a loaded model has them."""
    import torch.distributed as dist

    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".router." in name:
                dist.broadcast(param, src=0)


def _moe(rank: int, world: int) -> list[tuple]:
    setup_tp(world)
    shape = SHAPES["tiny"]
    moe = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=96)
    spec = {"num_experts": 4}
    results = []
    for dispatcher in ("allgather",):  # alltoall builds CUDA streams: GPU only
        for sp in (False, True):
            stock = build_model("stock", shape, LAYERS, world, spec_kwargs=spec,
                                moe_token_dispatcher_type=dispatcher, **moe)
            randomize_norms_(stock, seed=4)
            _same_router_on_every_rank_(stock)
            kind = "tokenweave_block" if sp else "tokenweave"
            tw = build_model(kind, shape, LAYERS, world, SPLIT, spec_kwargs=spec,
                             moe_token_dispatcher_type=dispatcher, sequence_parallel=sp, **moe)
            tw.load_state_dict(stock.state_dict(), strict=True)
            tokens = torch.randint(0, shape.vocab, (2, 18),
                                   generator=torch.Generator().manual_seed(6))
            want = forward(stock, tokens)
            with record_fused_calls() as calls:
                got = forward(tw, tokens)
            results.append((dispatcher, sp, rel_err(got, want), len(calls)))
    return results


def test_moe_allgather_is_woven():
    """Mixtral-style MoE with the all-gather dispatcher: the expert output's reduction is the fused
    op (two per layer per half) and the logits match the stock spec."""
    for dispatcher, sp, err, calls in run_ranks(_moe)[0]:
        case = f"dispatcher={dispatcher} sp={sp}"
        assert err <= 1e-5, f"{case}: rel error {err}"
        assert calls == 2 * 2 * LAYERS, f"{case}: fused op ran {calls} times"


def test_moe_policy_names_what_it_cannot_weave():
    from types import SimpleNamespace

    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    from megatron_tokenweave import moe

    config = SimpleNamespace(moe_expert_capacity_factor=None, moe_latent_size=None,
                             expert_tensor_parallel_size=None, tensor_model_parallel_size=2)

    def layer(dispatcher, **changes):
        return SimpleNamespace(config=SimpleNamespace(**{**vars(config), **changes}),
                               token_dispatcher=dispatcher, use_shared_expert=False)

    allgather = object.__new__(MoEAllGatherTokenDispatcher)
    allgather.ep_size = 1
    assert moe.unsupported_reason(layer(allgather)) is None
    assert "dispatcher" in moe.unsupported_reason(layer(SimpleNamespace(ep_size=1)))
    assert "capacity" in moe.unsupported_reason(layer(allgather, moe_expert_capacity_factor=1.0))
    assert "expert tensor" in moe.unsupported_reason(layer(allgather,
                                                           expert_tensor_parallel_size=1))
    allgather.ep_size = 2
    assert "expert parallelism" in moe.unsupported_reason(layer(allgather))
