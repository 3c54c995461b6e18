"""Serve a GPT model built with the TokenWeave spec through Megatron-Core's text generation
servers, one process per TP rank (random weights, the offline byte tokenizer):

  --server flask   Megatron's MegatronServer: PUT /api, POST /completions; static engine;
                   runs anywhere (gloo + reference op without GPUs)
  --server openai  Megatron's OpenAI-style server: POST /v1/completions; dynamic engine with its
                   coordinator; needs CUDA, flash-attn, quart, hypercorn, pyzmq, msgpack

    python examples/serve.py --port 5000
    curl -X PUT localhost:5000/api -H 'Content-Type: application/json' \\
         -d '{"prompts": ["Hello"], "tokens_to_generate": 16, "top_k": 1}'

Ctrl-C stops every rank. --spec stock serves the same weights with Megatron's own spec.
"""

from __future__ import annotations

import argparse
import asyncio

from megatron_tokenweave.launch import spawn


def run(rank: int, world: int, args: argparse.Namespace) -> None:
    from megatron_tokenweave.config import TokenWeaveConfig
    from megatron_tokenweave.cpu_compat import cpu_inference_scope
    from megatron_tokenweave.launch import initialize_model_parallel
    from megatron_tokenweave.models import Shape, stock_and_tokenweave
    from megatron_tokenweave.serving.engines import (
        dynamic_config_overrides,
        dynamic_llm,
        static_engine,
    )
    from megatron_tokenweave.serving.tokenizer import ByteTokenizer

    initialize_model_parallel(world)
    shape = Shape(args.hidden, 4 * args.hidden, 8, 4, vocab=256)
    capacity = args.max_batch * args.max_seq
    tw_config = TokenWeaveConfig.from_env(TokenWeaveConfig(max_tokens=capacity))
    overrides = dynamic_config_overrides() if args.server == "openai" else {}
    stock, woven = stock_and_tokenweave(shape, args.layers, world, tw_config, max_seq=args.max_seq,
                                        **overrides)
    model = woven if args.spec == "tokenweave" else stock
    tokenizer = ByteTokenizer(shape.vocab)
    if args.server == "openai":
        from megatron.core.inference.apis import ServeConfig

        llm = dynamic_llm(model, tokenizer, args.max_seq, max_requests=args.max_batch,
                          buffer_size_gb=args.kv_gb, serving=True)
        asyncio.run(llm.serve(ServeConfig(host=args.host, port=args.port)))
        return
    from megatron_tokenweave.serving.http import FlaskTextServer

    with cpu_inference_scope():
        engine = static_engine(model, tokenizer, args.max_batch, args.max_seq)
        server = FlaskTextServer(engine, args.max_batch, args.max_seq, args.host, args.port)
        if rank == 0:
            print(f"serving the {args.spec} spec on {server.url} (/api, /completions)", flush=True)
        server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", choices=["flask", "openai"], default="flask")
    parser.add_argument("--spec", choices=["tokenweave", "stock"], default="tokenweave")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=5000)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--max-seq", type=int, default=1024)
    parser.add_argument("--kv-gb", type=float, default=4.0)
    args = parser.parse_args()
    if args.server == "openai":
        from megatron_tokenweave.serving.engines import dynamic_engine_problem

        if (problem := dynamic_engine_problem()) is not None:
            raise SystemExit(f"--server openai: {problem}")
    spawn(run, args.tp, args, timeout=10 ** 9)


if __name__ == "__main__":
    main()
