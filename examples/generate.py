"""Greedy generation through Megatron-Core's inference engines, TokenWeave spec next to the stock
spec with the same weights, one process per TP rank.

The static engine runs everywhere (on a machine without GPUs: 2 gloo ranks, the reference op);
with --dynamic, Megatron's dynamic engine (MegatronLLM) runs too, which needs CUDA and
flash-attn. Weights are random, so the text is noise; what matters is that both specs generate
the same tokens. The tokenizer is megatron_tokenweave's offline byte tokenizer.

    python examples/generate.py
    python examples/generate.py --prompt "Hello" --tokens 32 --dynamic
"""

from __future__ import annotations

import argparse

from megatron_tokenweave.launch import RankFailed, Stopped, spawn


def run(rank: int, world: int, args: argparse.Namespace) -> dict:
    from megatron_tokenweave.config import TokenWeaveConfig
    from megatron_tokenweave.cpu_compat import cpu_inference_scope
    from megatron_tokenweave.launch import initialize_model_parallel
    from megatron_tokenweave.models import Shape, clear_attention_backend_env, stock_and_tokenweave
    from megatron_tokenweave.serving.engines import (
        dynamic_config_overrides,
        dynamic_llm,
        generated_tokens,
        greedy,
        static_engine,
    )
    from megatron_tokenweave.serving.tokenizer import ByteTokenizer

    initialize_model_parallel(world)
    shape = Shape(args.hidden, 4 * args.hidden, 8, 4, vocab=256)
    max_seq = max(len(p.encode()) for p in args.prompt) + args.tokens + 1
    tw_config = TokenWeaveConfig.from_env(TokenWeaveConfig(split_threshold=16))
    models = dict(zip(("stock", "tokenweave"),
                      stock_and_tokenweave(shape, args.layers, world, tw_config, max_seq=max_seq),
                      strict=True))
    tokenizer = ByteTokenizer(shape.vocab)
    out: dict = {}
    with cpu_inference_scope():
        for name, model in models.items():
            engine = static_engine(model, tokenizer, len(args.prompt), max_seq)
            done = engine.generate(prompts=args.prompt, sampling_params=greedy(args.tokens))
            out[("static", name)] = generated_tokens(done)
    if args.dynamic:  # a pair built for the dynamic engine's attention (other random weights)
        del models, model, engine, done  # the static engines hold the first pair
        clear_attention_backend_env()
        models = dict(zip(("stock", "tokenweave"),
                          stock_and_tokenweave(shape, args.layers, world, tw_config,
                                               max_seq=max_seq, **dynamic_config_overrides()),
                          strict=True))
        for name, model in models.items():
            llm = dynamic_llm(model, tokenizer, max_seq, max_requests=len(args.prompt),
                              chunk_tokens=256, buffer_size_gb=1.0)
            try:
                done = llm.generate([list(p.encode()) for p in args.prompt], greedy(args.tokens))
            finally:
                llm.shutdown()
            out[("dynamic", name)] = generated_tokens(done)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks")
    parser.add_argument("--prompt", nargs="+", default=["TokenWeave weaves", "Megatron serves"],
                        help="prompts, generated as one batch")
    parser.add_argument("--tokens", type=int, default=16, help="greedy tokens per prompt")
    parser.add_argument("--layers", type=int, default=2, help="transformer layers")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size")
    parser.add_argument("--dynamic", action="store_true", help="also the dynamic engine (GPU)")
    args = parser.parse_args()
    if args.dynamic:
        from megatron_tokenweave.serving.engines import dynamic_engine_problem

        if (problem := dynamic_engine_problem()) is not None:
            raise SystemExit(f"--dynamic: {problem}")
    try:
        result = spawn(run, args.tp, args)[0]
    except (RankFailed, Stopped) as err:  # one message, not the launcher's traceback
        raise SystemExit(f"generate.py: {err}") from None
    from megatron_tokenweave.serving.tokenizer import ByteTokenizer

    tok, same = ByteTokenizer(), True
    for engine in ("static", "dynamic"):
        if (engine, "stock") not in result:
            continue
        stock, woven = result[(engine, "stock")], result[(engine, "tokenweave")]
        same &= stock == woven
        print(f"{engine} engine: identical greedy tokens: {stock == woven}")
        for prompt, tokens in zip(args.prompt, woven, strict=True):
            print(f"  {prompt!r} -> {tok.detokenize(tokens)!r}")
    if not same:
        raise SystemExit("MISMATCH: the specs generated different tokens")
    print("OK")


if __name__ == "__main__":
    main()
