"""Serve a GPT model built with the TokenWeave spec through Megatron-Core's text generation
servers, one process per TP rank (random weights, the offline byte tokenizer).

  --server flask   Megatron's MegatronServer: PUT /api, POST /completions; static engine;
                   runs anywhere (gloo + reference op without GPUs)
  --server openai  Megatron's OpenAI-style server: POST /v1/completions; dynamic engine with its
                   coordinator; needs CUDA, flash-attn, quart, hypercorn, pyzmq, msgpack

    python examples/serve.py --port 5000
    curl -X PUT localhost:5000/api -H 'Content-Type: application/json' \\
         -d '{"prompts": ["Hello"], "tokens_to_generate": 16, "top_k": 1}'

Serves until stopped: Ctrl-C or `kill <pid>` (SIGINT/SIGTERM) stops every rank and exits 0.
--spec stock serves the same weights with Megatron's own spec.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Callable
from typing import Any

from megatron_tokenweave.launch import RankFailed, Stopped, spawn

PROG = os.path.basename(__file__)


def build_model(world: int, args: argparse.Namespace) -> Any:
    """The model to serve (in a rank). Its random weights depend only on --seed, so a stock and a
    TokenWeave server started apart hold the same weights."""
    import torch

    from megatron_tokenweave.config import TokenWeaveConfig
    from megatron_tokenweave.models import Shape, stock_and_tokenweave
    from megatron_tokenweave.serving.engines import dynamic_config_overrides

    shape = Shape(args.hidden, 4 * args.hidden, 8, 4, vocab=256)
    capacity = args.max_batch * args.max_seq
    tw_config = TokenWeaveConfig.from_env(TokenWeaveConfig(max_tokens=capacity))
    overrides = dynamic_config_overrides() if args.server == "openai" else {}
    torch.manual_seed(args.seed)
    stock, woven = stock_and_tokenweave(shape, args.layers, world, tw_config, max_seq=args.max_seq,
                                        **overrides)
    return woven if args.spec == "tokenweave" else stock


def run(rank: int, world: int, args: argparse.Namespace,
        prepare: Callable[[Any], None] | None = None) -> None:
    """One rank: build the model (`prepare` may adjust it), then serve until stopped."""
    from megatron_tokenweave.cpu_compat import cpu_inference_scope
    from megatron_tokenweave.launch import initialize_model_parallel
    from megatron_tokenweave.serving.tokenizer import ByteTokenizer

    initialize_model_parallel(world)
    model = build_model(world, args)
    if prepare is not None:
        prepare(model)
    tokenizer = ByteTokenizer(model.vocab_size)
    if args.server == "openai":
        from megatron.core.inference.apis import ServeConfig

        from megatron_tokenweave.serving.engines import dynamic_llm
        from megatron_tokenweave.serving.http import serve_openai

        llm = dynamic_llm(model, tokenizer, args.max_seq, max_requests=args.max_batch,
                          buffer_size_gb=args.kv_gb, serving=True)
        if rank == 0:
            print(f"serving the {args.spec} spec on http://{args.host}:{args.port} "
                  f"(/v1/completions)", flush=True)
        asyncio.run(serve_openai(llm, ServeConfig(host=args.host, port=args.port)))
        return
    from megatron_tokenweave.serving.engines import static_engine
    from megatron_tokenweave.serving.http import FlaskTextServer

    with cpu_inference_scope():
        engine = static_engine(model, tokenizer, args.max_batch, args.max_seq)
        server = FlaskTextServer(engine, args.host, args.port)
        if rank == 0:
            print(f"serving the {args.spec} spec on {server.url} (/api, /completions)", flush=True)
        server.serve_forever()


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                     epilog="Serves until Ctrl-C or `kill <pid>`: then every "
                                            "rank exits and so does this, with status 0.",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--server", choices=["flask", "openai"], default="flask",
                        help="flask: static engine, /api and /completions; openai: dynamic "
                             "engine, /v1/completions (GPU)")
    parser.add_argument("--spec", choices=["tokenweave", "stock"], default="tokenweave",
                        help="layer spec of the served model (same weights either way)")
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on")
    parser.add_argument("--port", type=int, default=5000,
                        help="HTTP port; 0 (flask): the system picks, the printed URL names it")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks")
    parser.add_argument("--layers", type=int, default=2, help="transformer layers")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size")
    parser.add_argument("--max-batch", type=int, default=8,
                        help="prompts per request (flask) or concurrent requests (openai)")
    parser.add_argument("--max-seq", type=int, default=1024,
                        help="prompt + generated tokens per prompt")
    parser.add_argument("--seed", type=int, default=1234, help="seed of the random weights")
    parser.add_argument("--kv-gb", type=float, default=4.0,
                        help="openai: KV cache of the dynamic engine, GB")
    return parser


def main(argv: list[str] | None = None, rank_fn: Callable = run) -> None:
    """Serve until SIGINT/SIGTERM (then one line, exit 0); a failed rank exits 1 naming it."""
    args = parser().parse_args(argv)
    if args.server == "openai" and args.port == 0:
        raise SystemExit(f"{PROG}: --server openai needs a port (Megatron's frontends bind it "
                         f"in forked processes that do not report a chosen one)")
    if args.server == "openai":
        from megatron_tokenweave.serving.engines import dynamic_engine_problem

        if (problem := dynamic_engine_problem()) is not None:
            raise SystemExit(f"{PROG}: --server openai: {problem}")
    try:
        spawn(rank_fn, args.tp, args, timeout=None)
    except Stopped as stop:
        print(f"{PROG}: {stop}; all {args.tp} ranks exited", flush=True)
        return
    except RankFailed as err:
        print(f"{PROG}: {err}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    print(f"{PROG}: the server stopped; all {args.tp} ranks exited", flush=True)


if __name__ == "__main__":
    main()
