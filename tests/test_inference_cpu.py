"""Static-batching inference (Megatron's StaticInferenceContext, KV cache) on 2 gloo ranks (TP=2,
no sequence parallelism, fp32): a prefill and DECODE_STEPS greedy decode steps give the same
logits with the TokenWeave spec as with the stock local spec.

One spawned job runs every session; the tests assert on what the ranks returned. The prefill is
above the split threshold (two halves); decode steps have one token per sequence, below it, and
must run the unsplit fused path (one half, 2 fused calls per layer over `batch` rows).
"""

from __future__ import annotations

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

from megatron_tokenweave.config import TokenWeaveConfig
from megatron_tokenweave.models import SHAPES

SHAPE = SHAPES["tiny"]
LAYERS = 3
DECODE_STEPS = 4
THRESHOLD = 16
# (batch, prompt length, InferenceMode active): prompts of batch * length >= THRESHOLD rows.
SESSIONS = ((3, 13, True), (1, 33, False), (2, 9, True))


def _step(model, context, tokens, start, mask):
    from megatron_tokenweave.cpu_compat import cpu_device_scope

    batch, seq = tokens.shape
    positions = torch.arange(start, start + seq).unsqueeze(0).expand(batch, -1)
    with cpu_device_scope(), torch.no_grad():
        return model(tokens, positions, attention_mask=mask, inference_context=context,
                     runtime_gather_output=True)


def _greedy(logits: torch.Tensor) -> torch.Tensor:
    """The next token of every sequence: argmax of the last position's (gathered) logits."""
    return logits[:, -1].argmax(dim=-1, keepdim=True)


def _inference_worker(rank: int, world: int) -> list[dict]:
    from megatron.core.inference.contexts import StaticInferenceContext
    from megatron.core.inference.utils import InferenceMode

    setup_tp(world)
    tw_config = TokenWeaveConfig(split_threshold=THRESHOLD, split_align=1, tuning_table="none")
    stock = build_model("stock", SHAPE, LAYERS, world, max_seq=128)
    randomize_norms_(stock, seed=5)
    woven = build_model("tokenweave", SHAPE, LAYERS, world, tw_config, max_seq=128)
    woven.load_state_dict(stock.state_dict(), strict=True)
    gen = torch.Generator().manual_seed(17)
    sessions = []
    for batch, prompt, engine_mode in SESSIONS:
        contexts = [StaticInferenceContext(batch, prompt + DECODE_STEPS + 1) for _ in range(2)]
        tokens = torch.randint(0, SHAPE.vocab, (batch, prompt), generator=gen)
        mask, start = causal_mask(prompt), 0
        steps = []
        if engine_mode:
            InferenceMode.set_active()
        try:
            for _ in range(DECODE_STEPS + 1):
                want = _step(stock, contexts[0], tokens, start, mask)
                with record_fused_calls() as calls:
                    got = _step(woven, contexts[1], tokens, start, mask)
                steps.append(dict(rows=tokens.numel(), err=rel_err(got, want),
                                  finite=bool(torch.isfinite(got).all()), calls=list(calls),
                                  shape=tuple(got.shape)))
                start += tokens.shape[1]
                for context in contexts:
                    context.sequence_len_offset = start
                tokens, mask = _greedy(want), None  # decode: the attention runs unmasked
        finally:
            InferenceMode.unset_active()
        sessions.append(dict(batch=batch, prompt=prompt, steps=steps,
                             cached=[sorted(c.key_value_memory_dict) for c in contexts]))
    return sessions


@pytest.fixture(scope="module")
def per_rank():
    return run_ranks(_inference_worker)


def test_prefill_and_greedy_decode_match_stock(per_rank):
    """Every step's logits (prefill, then DECODE_STEPS greedy decode steps) equal the stock
    model's within rel 1e-5, and both models cached keys/values for every layer."""
    for rank, sessions in enumerate(per_rank):
        assert len(sessions) == len(SESSIONS)
        for session in sessions:
            assert len(session["steps"]) == DECODE_STEPS + 1
            assert session["cached"] == [list(range(1, LAYERS + 1))] * 2
            for i, step in enumerate(session["steps"]):
                where = (rank, session["batch"], session["prompt"], i, step["err"])
                assert step["shape"][0] == session["batch"], where
                assert step["shape"][-1] == SHAPE.vocab, where  # gathered over TP
                assert step["finite"] and step["err"] <= 1e-5, where


def test_prefill_runs_split_fused_path(per_rank):
    """The prefill (above the threshold) runs two halves: 4 fused calls per layer."""
    for sessions in per_rank:
        for session in sessions:
            prefill = session["steps"][0]
            rows = session["batch"] * session["prompt"]
            assert prefill["rows"] == rows >= THRESHOLD
            assert prefill["calls"] == [(1, rows // 2), (1, rows - rows // 2)] * 2 * LAYERS


def test_decode_runs_unsplit_fused_path(per_rank):
    """Decode steps (one token per sequence, below the threshold) run one half: 2 fused calls
    per layer over all `batch` rows."""
    for sessions in per_rank:
        for session in sessions:
            for step in session["steps"][1:]:
                assert step["rows"] == session["batch"] < THRESHOLD
                assert step["calls"] == [(1, session["batch"])] * 2 * LAYERS
