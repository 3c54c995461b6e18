"""A tensor-parallel forward of a Llama-shaped model, stock spec vs TokenWeave spec.

Builds Megatron's HybridModel (the model class Megatron-Core now builds; `--pattern *-*-` is
attention and MLP layers, a decoder like GPTModel's) or, with `--model gpt`, a GPTModel. Spawns
one process per TP rank: NCCL on a node with a GPU per rank, gloo otherwise (ranks sharing one
GPU, or the CPU). Builds both models with the same weights, checks that their logits agree, says
what ran and, where each rank has a GPU of its own, prints the median forward time of each.

    python examples/tp_forward.py                     # TP=2, 1024 tokens, HybridModel *-*-*-*-
    python examples/tp_forward.py --tokens 4096 --sequence-parallel
    python examples/tp_forward.py --model gpt --layers 4
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from megatron_tokenweave.launch import spawn


def _timed(fn, iters: int) -> float:
    """Median wall time of fn() in ms, synchronising the GPU around each call."""
    times = []
    for _ in range(iters):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _build(args: argparse.Namespace, world: int, tw_config, use_te: bool, dtype: torch.dtype):
    """(stock, tokenweave, the stock side's name) with the same weights."""
    from megatron_tokenweave.cpu_compat import cpu_device_scope
    from megatron_tokenweave.hybrid import get_hybrid_stack_tokenweave_spec
    from megatron_tokenweave.models import (
        Shape,
        build_gpt,
        build_hybrid,
        llama_config,
        pattern_layers,
        stock_hybrid_stack_spec,
        stock_layer_spec,
    )
    from megatron_tokenweave.spec import get_gpt_decoder_block_tokenweave_spec

    shape = Shape(args.hidden, args.ffn, args.heads, args.kv_groups, vocab=args.vocab)
    common = dict(bf16=dtype == torch.bfloat16, params_dtype=dtype)
    seq = args.tokens
    with cpu_device_scope():
        # Megatron's local modules cannot run sequence parallelism; the math is the same without.
        if args.model == "hybrid":
            layers = pattern_layers(args.pattern)
            stock_cfg = llama_config(shape, layers, world, is_hybrid_model=True, **common)
            stock = build_hybrid(stock_cfg, stock_hybrid_stack_spec(use_te), shape.vocab, seq,
                                 args.pattern)
            tw_cfg = llama_config(shape, layers, world, is_hybrid_model=True,
                                  sequence_parallel=args.sequence_parallel, **common)
            tw = build_hybrid(tw_cfg, get_hybrid_stack_tokenweave_spec(use_te, tw_config),
                              shape.vocab, seq, args.pattern)
            name = f"HybridModel {args.pattern}, stock " + (
                "hybrid_stack_spec (TE)" if use_te else "hybrid stack on Megatron's local modules")
        else:
            stock_cfg = llama_config(shape, args.layers, world, **common)
            stock = build_gpt(stock_cfg, stock_layer_spec(shape, use_te), shape.vocab, seq)
            tw_cfg = llama_config(shape, args.layers, world,
                                  sequence_parallel=args.sequence_parallel, **common)
            tw_spec = get_gpt_decoder_block_tokenweave_spec(
                tw_cfg, use_transformer_engine=use_te, tokenweave_config=tw_config)
            tw = build_gpt(tw_cfg, tw_spec, shape.vocab, seq)
            name = f"GPTModel {args.layers} layers, stock " + ("TE" if use_te else "local") + \
                " spec"
    return stock, tw, name


def _what_ran(tw, world: int, hidden: int, dtype: torch.dtype, tw_config) -> tuple[str, bool]:
    """How the TokenWeave model communicated, and whether its timings mean anything (each rank
    on a device of its own)."""
    import torch.distributed as dist

    from megatron_tokenweave.communicator import find_communicator

    group = tw.decoder.layers[0].tp_group
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    comm = find_communicator(group, hidden, dtype, device, tw_config.backend)
    op = {"kernel": "the CUDA kernel (peer-to-peer over CUDA IPC)",
          "collectives": "NCCL collectives + add + norm",
          "reference": "the reference op"}[comm.backend]
    transport = dist.get_backend(group)
    gpus = torch.cuda.device_count()
    if not torch.cuda.is_available():
        return f"{transport}, {world} CPU ranks: {op}", False
    if gpus < world:
        return (f"{transport}, {world} ranks sharing {gpus} GPU: {op}; the ranks time-slice the "
                "GPU, so no timing is a performance figure"), False
    return f"{transport}, {world} GPUs: {op}", True


def run(rank: int, world: int, args: argparse.Namespace) -> dict:
    from megatron_tokenweave.config import TokenWeaveConfig
    from megatron_tokenweave.cpu_compat import cpu_device_scope
    from megatron_tokenweave.launch import initialize_model_parallel
    from megatron_tokenweave.spec import te_available

    gpu = torch.cuda.is_available()
    initialize_model_parallel(world)
    dtype = torch.bfloat16 if gpu else torch.float32
    use_te = gpu and te_available()
    tw_config = TokenWeaveConfig.from_env(TokenWeaveConfig(max_tokens=args.tokens * args.batch))
    stock, tw, name = _build(args, world, tw_config, use_te, dtype)
    if gpu:
        stock, tw = stock.cuda().to(dtype), tw.cuda().to(dtype)
    tw.load_state_dict(stock.state_dict(), strict=True)
    device = "cuda" if gpu else "cpu"
    seq = args.tokens
    gen = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, args.vocab, (args.batch, seq), generator=gen).to(device)
    positions = torch.arange(seq, device=device).unsqueeze(0).expand(args.batch, -1)
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=device), 1)[None, None]
    with cpu_device_scope(), torch.no_grad():
        ref = stock(tokens, positions, attention_mask=mask).float()
        out = tw(tokens, positions, attention_mask=mask).float()
        rel = ((out - ref).norm() / ref.norm()).item()
        ran, timed = _what_ran(tw, world, args.hidden, dtype, tw_config)
        times = None
        if timed:
            times = (_timed(lambda: stock(tokens, positions, attention_mask=mask), args.iters),
                     _timed(lambda: tw(tokens, positions, attention_mask=mask), args.iters))
    return {"rel_err": rel, "times": times, "name": name, "ran": ran}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--model", choices=("hybrid", "gpt"), default="hybrid")
    parser.add_argument("--pattern", default="*-*-*-*-", help="HybridModel's layer pattern")
    parser.add_argument("--layers", type=int, default=4, help="GPTModel's layers")
    parser.add_argument("--tokens", type=int, default=1024, help="sequence length")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=704)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-groups", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--sequence-parallel", action="store_true")
    args = parser.parse_args()
    r = spawn(run, args.tp, args)[0]
    tol = 2e-2 if torch.cuda.is_available() else 1e-5
    print(f"{r['name']}: TP={args.tp} tokens={args.tokens} batch={args.batch}")
    print(f"  ran: {r['ran']}")
    print(f"  logits rel. error vs the stock model: {r['rel_err']:.2e} (tolerance {tol})")
    if r["times"] is not None:
        print(f"  stock:      {r['times'][0]:8.2f} ms")
        print(f"  tokenweave: {r['times'][1]:8.2f} ms")
    if r["rel_err"] > tol:
        raise SystemExit("MISMATCH: the tokenweave model does not match the stock model")
    print("OK")


if __name__ == "__main__":
    main()
