"""Distributed checkpoints as Megatron users have them (megatron.core.dist_checkpointing, the
torch_dist format), on gloo ranks in fp32: a stock model's checkpoint loads into the TokenWeave
model and the TokenWeave model's into the stock one, at the same TP size and resharded (saved at
TP=2, loaded at TP=4), for GPTModel and HybridModel (`*-*-`); every load gives the saving
model's logits.

Job 1 (TP=2) saves the stock models, loads them into TokenWeave models, saves those, loads them
back into stock models, and returns the stock logits; job 2 (TP=4) loads both checkpoints into
models of each kind and compares with job 1's logits.
"""

from __future__ import annotations

import pytest
import torch
from _dist import (
    build_hybrid_model,
    build_model,
    forward,
    randomize_norms_,
    rel_err,
    run_ranks,
    setup_tp,
)

from megatron_tokenweave.config import TokenWeaveConfig
from megatron_tokenweave.models import SHAPES

SHAPE = SHAPES["tiny-tp8"]  # heads and query groups divide 2 and 4
SPLIT = TokenWeaveConfig(split_threshold=0, split_align=1, tuning_table="none")
PATTERN = "*-*-"
TOKENS = (2, 19)


def _build(model_class: str, kind: str, world: int):
    if model_class == "gpt":
        return build_model("stock" if kind == "stock" else "tokenweave", SHAPE, 2, world,
                           SPLIT if kind != "stock" else None)
    return build_hybrid_model(kind, SHAPE, PATTERN, world, SPLIT if kind != "stock" else None)


def _save(model, path: str) -> None:
    import os

    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron_tokenweave.cpu_compat import cpu_device_scope

    os.makedirs(path, exist_ok=True)  # dist_checkpointing.save writes into an existing folder
    dist.barrier()
    with cpu_device_scope():
        dist_checkpointing.save(model.sharded_state_dict(), path)


def _load(model, path: str):
    from megatron.core import dist_checkpointing

    from megatron_tokenweave.cpu_compat import cpu_device_scope

    with cpu_device_scope():
        state = dist_checkpointing.load(model.sharded_state_dict(), path)
    model.load_state_dict(state, strict=True)
    return model


def _tokens() -> torch.Tensor:
    return torch.randint(0, SHAPE.vocab, TOKENS, generator=torch.Generator().manual_seed(6))


def _logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """The whole vocabulary's logits (gathered over TP: TP=2 and TP=4 shard them differently)."""
    return forward(model, tokens, runtime_gather_output=True)


def _save_job(rank: int, world: int, root: str) -> dict:
    setup_tp(world)
    tokens, out = _tokens(), {}
    for model_class in ("gpt", "hybrid"):
        stock = _build(model_class, "stock", world)
        randomize_norms_(stock, seed=13)
        want = _logits(stock, tokens)
        stock_dir, woven_dir = f"{root}/{model_class}_stock", f"{root}/{model_class}_woven"
        _save(stock, stock_dir)
        woven = _load(_build(model_class, "tokenweave", world), stock_dir)
        into_woven = rel_err(_logits(woven, tokens), want)
        _save(woven, woven_dir)
        back = _load(_build(model_class, "stock", world), woven_dir)
        out[model_class] = dict(logits=want, into_woven=into_woven,
                                back=rel_err(_logits(back, tokens), want))
    return out


def _load_job(rank: int, world: int, root: str, logits: dict) -> dict:
    setup_tp(world)
    tokens, out = _tokens(), {}
    for model_class in ("gpt", "hybrid"):
        for saved in ("stock", "woven"):
            for kind in ("stock", "tokenweave"):
                model = _load(_build(model_class, kind, world), f"{root}/{model_class}_{saved}")
                out[(model_class, saved, kind)] = rel_err(_logits(model, tokens),
                                                          logits[model_class])
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("dist_ckpt"))
    return root, run_ranks(_save_job, root, world=2)


def test_stock_checkpoint_loads_into_tokenweave_and_back_at_the_same_tp(saved):
    """TP=2: the stock checkpoint into the TokenWeave model, and that model's checkpoint into
    a fresh stock model: the stock logits each time."""
    _, per_rank = saved
    for rank, out in enumerate(per_rank):
        for model_class, case in out.items():
            assert case["into_woven"] <= 1e-5, (rank, model_class, case["into_woven"])
            assert case["back"] <= 1e-6, (rank, model_class, case["back"])


def test_checkpoints_reshard_from_tp2_to_tp4(saved):
    """Saved at TP=2 (stock, and TokenWeave), loaded at TP=4 into stock and TokenWeave models:
    the TP=2 stock logits (within fp32 reduction order)."""
    root, per_rank = saved
    logits = {model_class: case["logits"] for model_class, case in per_rank[0].items()}
    for rank, out in enumerate(run_ranks(_load_job, root, logits, world=4)):
        assert len(out) == 8
        for key, err in out.items():
            assert err <= 1e-5, (rank, key, err)
