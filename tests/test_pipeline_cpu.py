"""Pipeline parallelism 2 x TP 2 on 4 gloo ranks (fp32): GPTModel and HybridModel (`*-|*-`),
each stage a model of its own layers, the stages' TP groups each with their own communicator.

The woven chain ends at each stage's last layer: its fused ops add without a norm (nothing is
handed past the stage: the next stage receives Megatron's hidden states), and the next stage's
first layer normalizes its own input. A pipelined forward (hidden states sent from stage to
stage, the last stage's logits) equals the stock pipeline's with the same weights, both
layouts; Megatron's static engine, pipelined (its PP forward: recv, forward, send), generates
the same greedy tokens with the woven stages as with the stock ones.
"""

from __future__ import annotations

import pytest
import torch
from _dist import (
    build_hybrid_model,
    build_model,
    forward,
    randomize_norms_,
    record_norms,
    rel_err,
    run_ranks,
    setup_tp,
)

from megatron_tokenweave.config import TokenWeaveConfig
from megatron_tokenweave.models import SHAPES

SHAPE = SHAPES["tiny"]
WORLD, PP = 4, 2
LAYERS = 4  # GPTModel: 2 a stage
PATTERN = "*-|*-"  # HybridModel: "*-" a stage
SPLIT = TokenWeaveConfig(split_threshold=0, split_align=1, tuning_table="none")
ENGINE = TokenWeaveConfig(split_threshold=16, split_align=1, tuning_table="none")
TOKENS = (2, 22)  # batch, sequence: 22 rows a sequence, 11 a shard with sequence parallelism
PROMPTS = ["pipeline", "parallel stages", "x"]
NEW_TOKENS, MAX_SEQ = 6, 64


def _stage() -> tuple[int, bool, bool]:
    from megatron.core import parallel_state

    return (parallel_state.get_pipeline_model_parallel_rank(),
            parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage())


def _build(model_class: str, kind: str, cfg=None, sp: bool = False, max_seq: int = 2048):
    _, first, last = _stage()
    stage = dict(pre_process=first, post_process=last)
    common = dict(pipeline_model_parallel_size=PP, pipeline_dtype=torch.float32,
                  sequence_parallel=sp)
    if model_class == "gpt":
        spec_kind = kind if kind == "stock" else "tokenweave_block"
        return build_model(spec_kind, SHAPE, LAYERS, WORLD // PP, cfg, max_seq=max_seq,
                           model_kwargs=stage, **common)
    return build_hybrid_model(kind, SHAPE, PATTERN, WORLD // PP, cfg, max_seq=max_seq,
                              model_kwargs=stage, **common)


def _pipelined(model, tokens: torch.Tensor, sp: bool) -> torch.Tensor | None:
    """One forward through the pipeline: stage 0 sends its hidden states to stage 1, whose
    logits are returned there (None on stage 0)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    _, first, last = _stage()
    batch, seq = tokens.shape
    if not first:
        rows = seq // (WORLD // PP) if sp else seq
        hidden = torch.empty(rows, batch, SHAPE.hidden)
        dist.recv(hidden, parallel_state.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(hidden)
    out = forward(model, tokens)
    if not last:
        dist.send(out.contiguous(), parallel_state.get_pipeline_model_parallel_next_rank())
        return None
    return out


def _pipeline_worker(rank: int, world: int) -> dict:
    from megatron_tokenweave.cpu_compat import cpu_inference_scope
    from megatron_tokenweave.serving.engines import generated_tokens, greedy, static_engine
    from megatron_tokenweave.serving.tokenizer import ByteTokenizer

    setup_tp(world, PP)
    stage, _, last = _stage()
    tokens = torch.randint(0, SHAPE.vocab, TOKENS, generator=torch.Generator().manual_seed(4))
    out: dict = {"stage": stage}
    for model_class in ("gpt", "hybrid"):
        stock = _build(model_class, "stock")
        randomize_norms_(stock, seed=9 + stage)
        want = _pipelined(stock, tokens, False)
        for sp in (False, True):
            woven = _build(model_class, "tokenweave", SPLIT, sp)
            woven.load_state_dict(stock.state_dict(), strict=True)
            chains = [layer._chain.successor(layer) is None for layer in woven.decoder.layers]
            with record_norms() as norms:
                got = _pipelined(woven, tokens, sp)
            out[(model_class, sp)] = dict(err=rel_err(got, want) if last else None,
                                          uses=[w is not None for w, _ in norms], ends=chains)
    # Megatron's static engine, pipelined: stock stages vs woven stages (after the plain
    # forwards: the engine leaves Megatron's inference mode set).
    for model_class in ("gpt", "hybrid"):
        stock = _build(model_class, "stock", max_seq=MAX_SEQ)
        randomize_norms_(stock, seed=21 + stage)
        woven = _build(model_class, "tokenweave", ENGINE, max_seq=MAX_SEQ)
        woven.load_state_dict(stock.state_dict(), strict=True)
        generated = {}
        with cpu_inference_scope():
            for name, model in (("stock", stock), ("tokenweave", woven)):
                engine = static_engine(model, ByteTokenizer(SHAPE.vocab), len(PROMPTS), MAX_SEQ)
                requests = engine.generate(prompts=PROMPTS, sampling_params=greedy(NEW_TOKENS))
                generated[name] = generated_tokens(requests)
        out[(model_class, "engine")] = generated
    return out


@pytest.fixture(scope="module")
def per_rank() -> list[dict]:
    return run_ranks(_pipeline_worker, world=WORLD)


@pytest.mark.parametrize("model_class", ["gpt", "hybrid"])
def test_pipelined_logits_match_the_stock_pipeline(per_rank, model_class):
    """The last stage's logits equal the stock pipeline's within rel 1e-5, both layouts."""
    for out in per_rank:
        for sp in (False, True):
            case = out[(model_class, sp)]
            if out["stage"] == PP - 1:
                assert case["err"] <= 1e-5, (out["stage"], model_class, sp, case)


@pytest.mark.parametrize("model_class", ["gpt", "hybrid"])
def test_the_woven_chain_ends_at_each_stage(per_rank, model_class):
    """Only each stage's last layer has no successor; its fused ops (two halves) add without a
    norm, every other op normalizes for the layer after it."""
    for out in per_rank:
        for sp in (False, True):
            case = out[(model_class, sp)]
            layers = len(case["ends"])
            assert layers == 2 and case["ends"] == [False, True], (model_class, case)
            ops_per_layer = 4 if model_class == "gpt" else 2  # GPT: two stages of two halves
            uses = case["uses"]
            assert len(uses) == layers * ops_per_layer, (model_class, case)
            assert uses == [True] * (len(uses) - 2) + [False, False], (model_class, case)


@pytest.mark.parametrize("model_class", ["gpt", "hybrid"])
def test_static_engine_pipelined_generates_the_stock_tokens(per_rank, model_class):
    """Greedy tokens of Megatron's static engine through the woven stages equal the stock
    stages' on the last stage, where they are sampled (and on every rank the engine returns
    them), and the run generated something."""
    last = [out for out in per_rank if out["stage"] == PP - 1]
    for out in last:
        generated = out[(model_class, "engine")]
        assert generated["tokenweave"] == generated["stock"]
        assert sum(len(t) for t in generated["stock"]) >= NEW_TOKENS
