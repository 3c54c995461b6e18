"""A tensor-parallel forward of a Llama-shaped GPTModel, stock spec vs TokenWeave spec.

Spawns one process per TP rank: NCCL on GPUs (the CUDA kernel when built), gloo on a machine
without GPUs (the reference op). Builds both models with the same weights, checks that their
logits agree and prints the median forward time of each.

    python examples/tp_forward.py                     # TP=2, 1024 tokens
    python examples/tp_forward.py --tokens 4096 --sequence-parallel
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


def run(rank: int, world: int, args: argparse.Namespace) -> dict:
    from megatron_tokenweave.config import TokenWeaveConfig
    from megatron_tokenweave.cpu_compat import cpu_device_scope
    from megatron_tokenweave.launch import initialize_model_parallel
    from megatron_tokenweave.models import Shape, build_gpt, llama_config, stock_layer_spec
    from megatron_tokenweave.spec import get_gpt_decoder_block_tokenweave_spec, te_available

    gpu = torch.cuda.is_available()
    initialize_model_parallel(world)
    shape = Shape(args.hidden, args.ffn, args.heads, args.kv_groups, vocab=args.vocab)
    dtype = torch.bfloat16 if gpu else torch.float32
    common = dict(bf16=gpu, params_dtype=dtype)
    use_te = gpu and te_available()
    stock_spec = stock_layer_spec(shape, use_te)
    tw_config = TokenWeaveConfig.from_env(TokenWeaveConfig(max_tokens=args.tokens * args.batch))
    seq = args.tokens
    with cpu_device_scope():
        # Megatron's local spec cannot run sequence parallelism; its math is the same without.
        stock_cfg = llama_config(shape, args.layers, world, **common)
        stock = build_gpt(stock_cfg, stock_spec, shape.vocab, seq)
        tw_cfg = llama_config(
            shape, args.layers, world, sequence_parallel=args.sequence_parallel, **common
        )
        tw_spec = get_gpt_decoder_block_tokenweave_spec(
            tw_cfg, use_transformer_engine=use_te, tokenweave_config=tw_config
        )
        tw = build_gpt(tw_cfg, tw_spec, shape.vocab, seq)
        if gpu:
            stock, tw = stock.cuda().to(dtype), tw.cuda().to(dtype)
        tw.load_state_dict(stock.state_dict(), strict=True)
        device = "cuda" if gpu else "cpu"
        gen = torch.Generator().manual_seed(1234)
        tokens = torch.randint(0, shape.vocab, (args.batch, seq), generator=gen).to(device)
        positions = torch.arange(seq, device=device).unsqueeze(0).expand(args.batch, -1)
        mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=device), 1)[None, None]
        with torch.no_grad():
            ref = stock(tokens, positions, attention_mask=mask).float()
            out = tw(tokens, positions, attention_mask=mask).float()
            rel = ((out - ref).norm() / ref.norm()).item()
            t_stock = _timed(lambda: stock(tokens, positions, attention_mask=mask), args.iters)
            t_tw = _timed(lambda: tw(tokens, positions, attention_mask=mask), args.iters)
    return {
        "rel_err": rel,
        "stock_ms": t_stock,
        "tokenweave_ms": t_tw,
        "stock": "TE" if use_te else "local",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=1024, help="sequence length")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=704)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-groups", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--sequence-parallel", action="store_true")
    args = parser.parse_args()
    results = spawn(run, args.tp, args)
    r = results[0]
    tol = 2e-2 if torch.cuda.is_available() else 1e-5
    backend = "NCCL + kernel" if torch.cuda.is_available() else "gloo + reference op (CPU)"
    print(f"TP={args.tp} tokens={args.tokens} batch={args.batch} layers={args.layers} [{backend}]")
    print(f"  logits rel. error vs stock {r['stock']} spec: {r['rel_err']:.2e} (tolerance {tol})")
    print(f"  stock {r['stock']} spec: {r['stock_ms']:8.2f} ms")
    print(f"  tokenweave spec:   {r['tokenweave_ms']:8.2f} ms")
    if r["rel_err"] > tol:
        raise SystemExit("MISMATCH: the tokenweave model does not match the stock model")
    print("OK")


if __name__ == "__main__":
    main()
