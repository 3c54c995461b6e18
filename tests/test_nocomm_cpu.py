"""The benchmarks' ceiling, "the same model with communication removed" (bench/nocomm.py), on 2
gloo ranks: inside `no_tp_comm()` the stock spec's row-parallel linears return this rank's
partial sum (the ranks' partials add up to the reduced output), and Megatron's static engine
still prefills and stops after one token on every rank, as the end-to-end benchmark runs it, and
generates a fixed number of tokens, the same on every rank, as its throughput ceiling runs it."""

from __future__ import annotations

import torch
import torch.distributed as dist
from _dist import build_model, forward, rel_err, run_ranks, setup_tp

from megatron_tokenweave.models import SHAPES

SHAPE = SHAPES["tiny"]


def _worker(rank: int, world: int) -> dict:
    from megatron_tokenweave.bench.nocomm import no_tp_comm
    from megatron_tokenweave.cpu_compat import cpu_inference_scope
    from megatron_tokenweave.serving.engines import generated_tokens, greedy, static_engine
    from megatron_tokenweave.serving.tokenizer import ByteTokenizer

    setup_tp(world)
    # Seeded: with these weights the first prompt's greedy tokens include the end-of-document
    # byte (seen with megatron-core 0.19.2 / torch 2.13), so the no-early-stop run is tested.
    torch.manual_seed(5)
    model = build_model("stock", SHAPE, 2, world, max_seq=64)
    proj = model.decoder.layers[0].self_attention.linear_proj
    x = torch.randn(5, 2, proj.weight.shape[1], generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        reduced = proj(x)[0]
        with no_tp_comm():
            partial = proj(x)[0]
    summed = partial.clone()
    dist.all_reduce(summed)
    tokens = torch.randint(0, SHAPE.vocab, (2, 12), generator=torch.Generator().manual_seed(9))
    logits = forward(model, tokens)
    with no_tp_comm():
        logits_nocomm = forward(model, tokens)
    logits_after = forward(model, tokens)
    with cpu_inference_scope(), no_tp_comm():
        engine = static_engine(model, ByteTokenizer(SHAPE.vocab), 2, 64)
        done = engine.generate(prompts=["a prompt of some bytes"], sampling_params=greedy(1))
        # The throughput ceiling: several tokens, no early stop.
        many = engine.generate(prompts=["first prompt", "other text!!"],
                               sampling_params=greedy(6, stop_at_eod=False))
    many_tokens = [list(t) for t in generated_tokens(many)]
    gathered: list = [None] * world
    dist.all_gather_object(gathered, many_tokens)
    return dict(partial_vs_reduced=rel_err(partial, reduced), summed=rel_err(summed, reduced),
                logits_nocomm=rel_err(logits_nocomm, logits),
                restored=rel_err(logits_after, logits),
                generated=[len(t) for t in generated_tokens(done)],
                many=[len(t) for t in many_tokens], ranks_agree=gathered[0] == gathered[1],
                eod_generated=any(ByteTokenizer(SHAPE.vocab).eod in t for t in many_tokens))


def test_no_tp_comm_removes_the_reductions_and_restores_them():
    for result in run_ranks(_worker):
        assert result["summed"] <= 1e-6  # the partials add up to the reduced output
        assert result["partial_vs_reduced"] > 1e-3  # and each alone is not it
        assert result["logits_nocomm"] > 1e-3  # the model ran without its reductions
        assert result["restored"] == 0.0  # and has them back after the scope
        assert result["generated"] == [1]  # prefill + one token, on every rank
        # The throughput ceiling's run: exactly the tokens asked for, the same on every rank
        # (the vocab-parallel logits are gathered, so every rank samples the same token).
        assert result["many"] == [6, 6] and result["ranks_agree"]
        assert result["eod_generated"]  # the case a stop at end-of-document would cut short
