"""Decoder-block benchmark: stock Megatron spec vs the same without communication vs TokenWeave.

    python -m megatron_tokenweave.bench block --out docs/results/block_tp2.json

Per model shape, one 2-rank NCCL run builds a block of `--layers` layers for each implementation
with the same weights and times them interleaved (CUDA events, medians). `tokens` is the total
token count of one forward (batch sequences of tokens/batch each). Implementations:
  <stock>         Megatron's TE spec (`te`) when TE imports, else its local spec (`local`)
  <stock>_nocomm  the same with the row-parallel all-reduce made a no-op (the ceiling; MoE
                  shapes keep their dispatcher's collectives: bench/nocomm.py)
  <stock>_sp      with --stock-sp: the stock spec with sequence parallelism (for MoE shapes the
                  stock layout to compare with: without it, Megatron's MoE dispatchers gather
                  every TP rank's copy of the same tokens and the experts compute them twice)
  tokenweave      the TokenWeave spec (replicated layout, like the stock spec), default config
                  (split, mechanism and CTAs per token count from the tuned table)
  tokenweave_sp   the TokenWeave spec with sequence parallelism (TokenWeave's own layout)
  tokenweave_sp_split / _nosplit  the same, always / never split (to place the threshold)
  tokenweave_ce / tokenweave_sp_ce  either layout on the kernel's copy-engine data path
                  (config defaults: split from 1K tokens, 16 CTAs per phase; no table)
  tokenweave_split / tokenweave_ce_split  replicated, always split (no table): the SM-driven
                  op beside the GEMMs (32 CTAs), or the copy-engine path with only the transfers
                  beside the GEMMs and the reductions on the main stream (128 CTAs)
With `--model-classes gpt hybrid`, also the same layers as Megatron's HybridModel stack
(pattern `*-` per GPT layer, `*E` for MoE shapes; the GPT block's weights):
  <stock>_hybrid     Megatron's hybrid stack spec (TE's `hybrid_stack_spec`, else its local form)
  tokenweave_hybrid  the TokenWeave hybrid stack spec, default config (replicated)
Every row says its `model_class` ("gpt" or "hybrid") and its GEMMs' `precision` ("bf16", or with
`--fp8-recipe R` "fp8-e4m3-R": every block's GEMMs in TE's FP8 recipe R, e4m3; the TokenWeave
blocks' woven linears then run TE's FP8 GEMMs half by half).
Modes: `graph` times CUDA-graph replays of the whole block (GPU time, as served with graphs);
`eager` times plain Python forwards (launch overhead included). MoE shapes dispatch as
`--moe-dispatch` says (models.MOE_DISPATCH): `allgather` (dropless; it copies token counts to the
host, which a graph cannot capture: eager only) or `padded` (all-to-all, every expert padded to a
capacity that drops nothing: capturable, experts / top-k x the expert FLOPs); the rows say which.
Without TE every spec gets the same SDPA (flash) core attention (bench/sdpa.py) instead of
Megatron's unfused local attention.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json

import torch
from tqdm import tqdm

from megatron_tokenweave.bench import add_fp8_recipe_argument, check_fp8_recipe, command_parser
from megatron_tokenweave.bench.nocomm import no_tp_comm
from megatron_tokenweave.bench.report import save_plot, write_result
from megatron_tokenweave.launch import spawn
from megatron_tokenweave.models import MOE_DISPATCH, SHAPES, llama_config, stock_layer_spec
from megatron_tokenweave.precision import bench_precision, fp8_fields

# name: (sequence parallel, TokenWeaveConfig overrides)
VARIANTS = {
    "tokenweave": (False, {}),
    "tokenweave_sp": (True, {}),
    "tokenweave_sp_split": (True, {"split_threshold": 0, "tuning_table": "none"}),
    "tokenweave_sp_nosplit": (True, {"split_threshold": 1 << 30, "tuning_table": "none"}),
    "tokenweave_ce": (False, {"comm": "copy_engine", "tuning_table": "none"}),
    "tokenweave_sp_ce": (True, {"comm": "copy_engine", "tuning_table": "none"}),
    # Always split (replicated): on the SM-driven path, and on the copy-engine path with the
    # reductions on the main stream (128 CTAs).
    "tokenweave_split": (False, {"split_threshold": 0, "comm_ctas_attn": 32,
                                 "comm_ctas_mlp": 32, "tuning_table": "none"}),
    "tokenweave_ce_split": (False, {"comm": "copy_engine", "split_threshold": 0,
                                    "comm_ctas_attn": 128, "comm_ctas_mlp": 128,
                                    "tuning_table": "none"}),
}


def hybrid_blocks(shape, layers: int, world: int, use_te: bool, tw_cfg, common: dict,
                  gpt_state: dict, attn) -> dict[str, torch.nn.Module]:
    """`<stock>_hybrid` and `tokenweave_hybrid`: the `layers` GPT layers of a block as a hybrid
    stack of 2 * layers single-mixer layers, with the GPT block's weights (strict loads)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module

    from megatron_tokenweave.hybrid import (
        get_hybrid_stack_tokenweave_spec,
        gpt_to_hybrid_state_dict,
    )
    from megatron_tokenweave.models import stock_hybrid_stack_spec

    pattern = ("*E" if shape.experts else "*-") * layers
    cfg = llama_config(shape, len(pattern), world, is_hybrid_model=True, **common)
    state = {k.removeprefix("decoder."): v for k, v in gpt_to_hybrid_state_dict(
        {f"decoder.{k}": v for k, v in gpt_state.items()}).items()}
    specs = {f"{'te' if use_te else 'local'}_hybrid": stock_hybrid_stack_spec(use_te),
             "tokenweave_hybrid": get_hybrid_stack_tokenweave_spec(use_te, tw_cfg)}
    blocks = {}
    for name, spec in specs.items():
        block = build_module(attn(spec), cfg, pre_process=True, post_process=True,
                             layer_type_list=list(pattern), dtype=cfg.params_dtype,
                             pg_collection=ProcessGroupCollection.use_mpu_process_groups())
        block.load_state_dict(state, strict=True)
        blocks[name] = block
    return blocks


def model_class(impl: str) -> str:
    """The model class a block implementation's layers are Megatron's layers of."""
    return "hybrid" if impl.endswith("_hybrid") else "gpt"


def graphed(fn):
    """Capture fn(0) in a CUDA graph (after an eager warm-up); return a replaying callable."""
    fn(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(0)
    return lambda i: graph.replay()


def _run(rank: int, world: int, args: argparse.Namespace) -> list[dict]:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.transformer_block import TransformerBlock

    from megatron_tokenweave.bench.sdpa import with_sdpa
    from megatron_tokenweave.bench.timing import interleaved_medians
    from megatron_tokenweave.config import TokenWeaveConfig
    from megatron_tokenweave.launch import initialize_model_parallel
    from megatron_tokenweave.spec import get_gpt_decoder_block_tokenweave_spec, te_available

    initialize_model_parallel(world)
    use_te = te_available() and not args.local
    stock_name = "te" if use_te else "local"
    base_cfg = TokenWeaveConfig.from_env(TokenWeaveConfig(max_tokens=max(args.tokens)))
    rows: list[dict] = []
    progress = tqdm(total=len(args.models) * len(args.tokens) * len(args.batch), desc="block",
                    unit="case", disable=rank != 0)
    for model in args.models:
        shape = SHAPES[model]
        extra = shape.spec_kwargs()
        # The all-gather MoE dispatcher reads token counts on the host: no CUDA-graph capture.
        dispatch = args.moe_dispatch if shape.experts else None
        modes = ["eager"] if dispatch == "allgather" else args.modes
        stock_spec = stock_layer_spec(shape, use_te)
        common = dict(bf16=True, params_dtype=torch.bfloat16, moe_dispatch=args.moe_dispatch,
                      **fp8_fields(args.fp8_recipe))
        cfg = llama_config(shape, args.layers, world, **common)
        precision = bench_precision(args.fp8_recipe)
        cfg_sp = llama_config(shape, args.layers, world, sequence_parallel=True, **common)
        attn = (lambda spec: spec) if use_te else with_sdpa
        blocks = {stock_name: TransformerBlock(cfg, attn(stock_spec))}
        if args.stock_sp:
            blocks[f"{stock_name}_sp"] = TransformerBlock(cfg_sp, attn(stock_spec))
        variants = {name: VARIANTS[name] for name in args.variants}
        for name, (sp, overrides) in variants.items():
            block_cfg = cfg_sp if sp else cfg
            tw_cfg = dataclasses.replace(base_cfg, **overrides)
            spec = get_gpt_decoder_block_tokenweave_spec(block_cfg, use_te, tw_cfg, **extra)
            blocks[name] = TransformerBlock(block_cfg, attn(spec))
        state = blocks[stock_name].state_dict()
        for name, block in blocks.items():
            if name != stock_name:
                block.load_state_dict(state, strict=True)
        if "hybrid" in args.model_classes:
            blocks.update(hybrid_blocks(shape, args.layers, world, use_te,
                                        base_cfg, common, state, attn))
        for block in blocks.values():
            block.cuda().to(torch.bfloat16).eval()
        rope = RotaryEmbedding(kv_channels=cfg.kv_channels, rotary_percent=1.0)
        for tokens in args.tokens:
            for batch in args.batch:
                seq = tokens // batch
                rpe = rope(seq)
                gen = torch.Generator(device="cuda").manual_seed(1234)  # same on every rank
                inputs = [
                    torch.randn(seq, batch, shape.hidden, device="cuda", dtype=torch.bfloat16,
                                generator=gen)
                    for _ in range(3)
                ]
                shard = seq // world
                inputs_sp = [x[rank * shard : (rank + 1) * shard].contiguous() for x in inputs]

                def eager(block, xs, nocomm=False, rpe=rpe):
                    def fn(i):
                        with no_tp_comm() if nocomm else contextlib.nullcontext():
                            return block(hidden_states=xs[i % len(xs)], attention_mask=None,
                                         rotary_pos_emb=rpe)
                    return fn

                builders = {
                    stock_name: (blocks[stock_name], inputs, False),
                    f"{stock_name}_nocomm": (blocks[stock_name], inputs, True),
                    **({f"{stock_name}_sp": (blocks[f"{stock_name}_sp"], inputs_sp, False)}
                       if args.stock_sp else {}),
                    **{name: (blocks[name], inputs_sp if sp else inputs, False)
                       for name, (sp, _) in variants.items()},
                    **{name: (block, inputs, False) for name, block in blocks.items()
                       if model_class(name) == "hybrid"},
                }
                med = {}
                with torch.no_grad():
                    if "eager" in modes:
                        cands = {k: eager(*v) for k, v in builders.items()}
                        res = interleaved_medians(cands, iters=args.iters, warmup=args.warmup)
                        med.update({(k, "eager"): v for k, v in res.items()})
                    if "graph" in modes:
                        cands = {k: graphed(eager(*v)) for k, v in builders.items()}
                        res = interleaved_medians(cands, iters=args.iters, warmup=args.warmup)
                        med.update({(k, "graph"): v for k, v in res.items()})
                        del cands
                moe_row = {"moe_dispatch": dispatch} if dispatch else {}
                new = [dict(model=model, impl=impl, model_class=model_class(impl),
                            precision=precision, mode=mode,
                            tokens=tokens, batch=batch, tp=world, us=round(us, 1), **moe_row)
                       for (impl, mode), us in med.items()]
                rows += new
                if rank == 0:  # kept as measured, should a later case fail
                    with open(args.out + ".rows.jsonl", "a") as f:
                        f.writelines(json.dumps(row) + "\n" for row in new)
                    progress.write(f"{model} T={tokens} b={batch}: " + "  ".join(
                        f"{k}/{m}={v:.0f}us" for (k, m), v in med.items()))
                progress.update()
        del blocks
        torch.cuda.empty_cache()
    progress.close()
    return rows


def _plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in result["rows"]})
    batches = sorted({r["batch"] for r in result["rows"]})
    fig, axes = plt.subplots(len(models), len(batches), figsize=(6 * len(batches), 4 * len(models)),
                             squeeze=False)
    stock = next(r["impl"] for r in result["rows"] if r["impl"] in ("te", "local"))
    for i, model in enumerate(models):
        for j, batch in enumerate(batches):
            ax = axes[i][j]
            rows = [r for r in result["rows"] if r["model"] == model and r["batch"] == batch]
            mode = "graph" if any(r.get("mode", "graph") == "graph" for r in rows) else "eager"
            sel = [r for r in rows if r.get("mode", "graph") == mode]
            base = {r["tokens"]: r["us"] for r in sel if r["impl"] == stock}
            for impl in sorted({r["impl"] for r in sel}):
                pts = sorted((r["tokens"], base[r["tokens"]] / r["us"]) for r in sel
                             if r["impl"] == impl)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
            ax.set_xscale("log", base=2)
            ax.axhline(1.0, color="gray", lw=0.8)
            how = "CUDA graphs" if mode == "graph" else "eager"
            ax.set_title(f"{model}, batch {batch}, TP={sel[0]['tp']}, {how}")
            ax.set_xlabel("tokens per forward")
            ax.set_ylabel(f"speed-up over {stock} (higher is better)")
            ax.legend()
    fig.tight_layout()
    save_plot(fig, path, dpi=110)


def parser() -> argparse.ArgumentParser:
    parser = command_parser("block", __doc__)
    parser.add_argument("--models", nargs="+", default=["llama-3.3-70b", "llama-3-8b"],
                        choices=sorted(SHAPES), metavar="MODEL",
                        help=f"model shapes to time, of {', '.join(sorted(SHAPES))}")
    parser.add_argument("--tokens", nargs="+", type=int, default=[512, 1024, 2048, 4096, 8192],
                        help="tokens of one forward (all sequences together)")
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 4],
                        help="sequences per forward (tokens/batch tokens each)")
    parser.add_argument("--layers", type=int, default=4, help="layers of the timed block")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks, one GPU each")
    parser.add_argument("--iters", type=int, default=20,
                        help="timed forwards per implementation (interleaved; medians)")
    parser.add_argument("--warmup", type=int, default=5,
                        help="untimed forwards per implementation before timing")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                        help="TokenWeave variants to time beside the stock spec and its ceiling")
    parser.add_argument("--local", action="store_true", help="stock = local spec even with TE")
    parser.add_argument("--model-classes", nargs="+", default=["gpt"], choices=["gpt", "hybrid"],
                        help="also time the layers as Megatron's HybridModel stack (hybrid: "
                             "<stock>_hybrid and tokenweave_hybrid, the GPT block's weights)")
    parser.add_argument("--stock-sp", action="store_true",
                        help="also time the stock spec with sequence parallelism (<stock>_sp)")
    parser.add_argument("--moe-dispatch", choices=MOE_DISPATCH, default="allgather",
                        help="MoE shapes: allgather (dropless, eager only) or padded (all-to-all "
                             "padded to a capacity that drops nothing: CUDA graphs too)")
    add_fp8_recipe_argument(parser, "every block's GEMMs")
    parser.add_argument("--modes", nargs="+", default=["graph", "eager"],
                        choices=["graph", "eager"],
                        help="graph: CUDA-graph replays (GPU time); eager: Python launches too")
    parser.add_argument("--out", default="docs/results/block_tp2.json",
                        help="result JSON (plot beside it; rows also appended to OUT.rows.jsonl "
                             "as measured)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    check_fp8_recipe(args)
    if torch.cuda.device_count() < args.tp:
        raise SystemExit(f"the block benchmark needs {args.tp} GPUs")
    rows = spawn(_run, args.tp, args)[0]
    write_result("block", argv, rows, args.out, _plot)


if __name__ == "__main__":
    main()
