"""More model families on the reference path (gloo, TP=2): Qwen2.5-style attention with QKV bias
(tied and untied embeddings, sequence parallelism on and off) runs the fused path and matches the
stock spec; an MoE (Mixtral-style) layer is not woven yet and takes the stock path, exactly."""

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


def _moe(rank: int, world: int) -> tuple[float, int]:
    setup_tp(world)
    shape = SHAPES["tiny"]
    moe = dict(num_moe_experts=4, moe_router_topk=2, moe_token_dispatcher_type="allgather",
               moe_ffn_hidden_size=96)
    stock = build_model("stock", shape, LAYERS, world, spec_kwargs={"num_experts": 4}, **moe)
    tw = build_model("tokenweave", shape, LAYERS, world, SPLIT, spec_kwargs={"num_experts": 4},
                     **moe)
    tw.load_state_dict(stock.state_dict(), strict=True)
    tokens = torch.randint(0, shape.vocab, (2, 17), generator=torch.Generator().manual_seed(6))
    want = forward(stock, tokens)
    with record_fused_calls() as calls:
        got = forward(tw, tokens)
    return rel_err(got, want), len(calls)


def test_moe_layers_take_the_stock_path():
    for err, calls in run_ranks(_moe):
        assert err == 0.0
        assert calls == 0
