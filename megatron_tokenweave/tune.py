"""Autotuner: measure the split policy table for a model shape on this machine.

    python -m megatron_tokenweave.tune --model llama-3.3-70b --tp 2

For each layout (replicated, sequence parallel), each execution mode (CUDA-graph replays, eager
forwards; MoE shapes: eager with the all-gather dispatcher, CUDA graphs with the padded all-to-all
one, `--moe-dispatch`) and every token count of the grid it times, interleaved, a
block of TokenWeave layers with the tokens not split (several CTA counts) and split (several CTA
counts per phase), and the same with the stock collectives instead of the fused kernel, and
keeps the fastest (the unsplit fused plan unless another wins by more than --min-gain). One
table per layout and mode goes to the cache that `TokenWeaveConfig(tuning_table="auto")` reads
(~/.cache/megatron_tokenweave/tuning/, or TOKENWEAVE_CACHE), or to --out-dir.
A few dozen candidates: minutes, not TokenWeave's day-long grid search.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from megatron_tokenweave.launch import spawn
from megatron_tokenweave.models import MOE_DISPATCH, SHAPES, Shape, llama_config
from megatron_tokenweave.policy import CACHE_DIR, TableKey
from megatron_tokenweave.precision import gemm_precision

NEVER = 1 << 40
ALONE_CTAS = (32, 64, 128)
SPLIT_CTAS = ((8, 8), (16, 16), (32, 32))
# Copy-engine split: the reduction runs alone on the main stream (many CTAs), except in the
# sequence-parallel layout with a norm, where the whole op stays beside the GEMM (few CTAs).
CE_SPLIT_CTAS = (16, 64, 128)
GEMM_SPLIT_CTAS = (8, 16)


def candidates() -> dict[str, dict]:
    """Name -> TokenWeaveConfig overrides of every candidate plan: the fused kernel unsplit and
    split at several CTA counts, on its SM-driven and its copy-engine data path (there: the
    transfer beside the GEMMs, the reduction on the main stream), the stock collectives
    unsplit and split (on the side stream), and the GEMM-fused mechanism unsplit and split.
    (A GEMM SM carve-out lost everywhere it was measured, so it is not searched.)"""
    out = {f"alone{c}": dict(split_threshold=NEVER, comm_ctas_alone=c) for c in ALONE_CTAS}
    out.update({
        f"split{a}/{m}": dict(split_threshold=0, comm_ctas_attn=a, comm_ctas_mlp=m)
        for a, m in SPLIT_CTAS
    })
    out.update({
        f"ce_split{c}": dict(split_threshold=0, comm_ctas_attn=c, comm_ctas_mlp=c,
                             comm="copy_engine")
        for c in CE_SPLIT_CTAS
    })
    out["ce_alone128"] = dict(split_threshold=NEVER, comm_ctas_alone=128, comm="copy_engine")
    out["collectives"] = dict(split_threshold=NEVER, comm="collectives")
    out["collectives_split"] = dict(split_threshold=0, comm="collectives")
    # GEMM-fused: the row GEMMs store their tiles into the owners' inboxes; the owner's
    # reduction runs alone (all SMs to it) or beside the other half's GEMM (the GEMM takes the
    # SMs it leaves).
    out["gemm_alone"] = dict(split_threshold=NEVER, comm_ctas_alone=64, comm="gemm")
    out.update({
        f"gemm_split{c}": dict(split_threshold=0, comm_ctas_attn=c, comm_ctas_mlp=c, comm="gemm")
        for c in GEMM_SPLIT_CTAS
    })
    return out


def pick(times: dict[str, float], min_gain: float) -> str:
    """The fastest candidate, but the fastest unsplit fused plan (the simplest) unless another
    beats it by more than `min_gain` (a fraction): differences inside the timing noise must not
    flip a table to a split or to collectives."""
    best = min(times, key=times.get)
    simple = min((k for k in times if k.startswith("alone")), key=times.get)
    return best if times[best] < (1.0 - min_gain) * times[simple] else simple


def _entry(min_tokens: int, name: str) -> dict:
    overrides = dict(candidates()[name])
    return {"min_tokens": min_tokens, "split": overrides.pop("split_threshold") == 0, **overrides}


def table_entries(measured: dict[int, dict[str, float]], min_gain: float) -> list[dict]:
    """Table entries from the measured times: from each measured token count on, its pick;
    below the smallest one (decode, short prompts) the unsplit fused plan that was fastest there,
    never a split measured only at a larger count."""
    counts = sorted(measured)
    if not counts:
        return []
    first = measured[counts[0]]
    simple = min((k for k in first if k.startswith("alone")), key=first.get)
    entries = [_entry(0, simple)]
    for tokens in counts:
        entries.append(_entry(tokens, pick(measured[tokens], min_gain)))
    return entries


def _out_of_time(elapsed: float, budget: float) -> bool:
    """Rank 0's clock decides for every rank, so all of them stop after the same token count."""
    import torch.distributed as dist

    flag = torch.tensor([float(elapsed > budget)], device="cuda")
    dist.broadcast(flag, src=0)
    return bool(flag.item())


def _tune(rank: int, world: int, args: argparse.Namespace, shape: Shape) -> list[dict]:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.transformer_block import TransformerBlock

    from megatron_tokenweave.bench.block import graphed
    from megatron_tokenweave.bench.sdpa import with_sdpa
    from megatron_tokenweave.bench.timing import interleaved_medians
    from megatron_tokenweave.config import TokenWeaveConfig
    from megatron_tokenweave.launch import initialize_model_parallel
    from megatron_tokenweave.spec import get_gpt_decoder_block_tokenweave_spec, te_available

    initialize_model_parallel(world)
    use_te = te_available()
    dtype = torch.bfloat16
    base = TokenWeaveConfig(max_tokens=max(args.tokens), tuning_table="none")
    rope = RotaryEmbedding(kv_channels=shape.hidden // shape.heads, rotary_percent=1.0)
    plans = candidates()
    if shape.experts:  # MoE layers take the fused op for "gemm" (the expert layer's own GEMMs)
        plans = {name: plan for name, plan in plans.items() if plan.get("comm") != "gemm"}
    # The all-gather MoE dispatcher reads token counts on the host: eager only. The padded one
    # is capturable: graph tables only (its eager table would take the all-gather one's name).
    modes = args.modes
    if shape.experts:
        modes = ["eager"] if args.moe_dispatch == "allgather" else ["graph"]
        if rank == 0 and modes != args.modes:
            print(f"MoE shape, {args.moe_dispatch} dispatch: tuning {modes[0]} forwards only")
    total = len(args.layouts) * len(modes) * len(args.tokens) * len(plans)
    progress = tqdm(total=total, desc="tuning", unit="plan", disable=rank != 0)
    tables = []
    for layout in args.layouts:
        sp = layout == "sp"
        cfg = llama_config(shape, args.layers, world, sequence_parallel=sp, bf16=True,
                           params_dtype=dtype, moe_dispatch=args.moe_dispatch)
        spec = get_gpt_decoder_block_tokenweave_spec(cfg, use_te, base, **shape.spec_kwargs())
        block = TransformerBlock(cfg, spec if use_te else with_sdpa(spec)).cuda().to(dtype).eval()
        for mode in modes:
            measured, table_start = {}, time.time()
            for tokens in sorted(args.tokens):
                x = torch.randn(tokens // world if sp else tokens, 1, shape.hidden, device="cuda",
                                dtype=dtype)
                rpe = rope(tokens)
                runs = {}
                with torch.no_grad():
                    for name, overrides in plans.items():
                        for layer in block.layers:
                            layer.tokenweave_config = dataclasses.replace(base, **overrides)

                        def run(i, x=x, rpe=rpe, block=block):
                            return block(hidden_states=x, attention_mask=None,
                                         rotary_pos_emb=rpe)

                        runs[name] = graphed(run) if mode == "graph" else run
                        progress.set_postfix_str(f"{layout} {mode} T={tokens} {name}")
                        progress.update()
                    iters = args.iters if mode == "graph" else 3 * args.iters  # eager: noisier
                    times = interleaved_medians(runs, iters=iters, warmup=3)
                del runs
                torch.cuda.empty_cache()
                measured[tokens] = {k: round(v, 1) for k, v in times.items()}
                if _out_of_time(time.time() - table_start,
                                args.budget_s / (len(args.layouts) * len(modes))):
                    break
            key = TableKey.of(torch.device("cuda"), world, shape.hidden, dtype, sp,
                              bool(shape.experts), mode == "graph", gemm_precision(cfg))
            tables.append({**dataclasses.asdict(key),
                           "entries": table_entries(measured, args.min_gain),
                           "measured_us": measured, "layers": args.layers,
                           **({"moe_dispatch": args.moe_dispatch} if shape.experts else {})})
        del block
        torch.cuda.empty_cache()
    progress.close()
    return tables


PROG = "python -m megatron_tokenweave.tune"
CUSTOM_SHAPE = ("hidden", "ffn", "heads", "kv_groups")


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default="llama-3.3-70b", choices=sorted(SHAPES),
                        metavar="MODEL", help=f"model shape, of {', '.join(sorted(SHAPES))}")
    parser.add_argument("--hidden", type=int,
                        help="a custom dense shape instead of --model: hidden size (with --ffn, "
                             "--heads and --kv-groups)")
    parser.add_argument("--ffn", type=int, help="custom shape: MLP hidden size")
    parser.add_argument("--heads", type=int, help="custom shape: attention heads")
    parser.add_argument("--kv-groups", type=int, help="custom shape: key/value head groups")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks, one GPU each")
    parser.add_argument("--layers", type=int, default=4,
                        help="layers of the timed block: the split's cross-layer hand-off "
                             "shows only with several (a 2-layer block has one, a 4-layer block "
                             "three)")
    parser.add_argument("--tokens", nargs="+", type=int, default=[512, 1024, 2048, 4096, 8192],
                        help="token counts of one forward to measure (the table's grid)")
    parser.add_argument("--layouts", nargs="+", choices=["replicated", "sp"],
                        default=["replicated", "sp"],
                        help="replicated: what Megatron's inference engines run; sp: sequence "
                             "parallel. Each layout gets its own table.")
    parser.add_argument("--modes", nargs="+", choices=["graph", "eager"],
                        default=["graph", "eager"],
                        help="time CUDA-graph replays and/or eager forwards (each its own table; "
                             "MoE shapes: as --moe-dispatch allows)")
    parser.add_argument("--moe-dispatch", choices=MOE_DISPATCH, default="allgather",
                        help="MoE shapes: allgather (eager tables) or padded (graph tables)")
    parser.add_argument("--iters", type=int, default=10, help="timings per candidate (eager: 3x)")
    parser.add_argument("--min-gain", type=float, default=0.01,
                        help="a split or collectives plan must beat the best unsplit fused plan "
                             "by this fraction to be chosen")
    parser.add_argument("--budget-s", type=float, default=540.0,
                        help="time budget, s: each table stops adding token counts once its "
                             "share is spent")
    parser.add_argument("--out-dir",
                        help="write the tables here (default: the cache the layer reads)")
    return parser


def main(argv: list[str] | None = None) -> None:
    cli = parser()
    args = cli.parse_args(argv)
    custom = [getattr(args, name) for name in CUSTOM_SHAPE]
    if any(custom) and not all(custom):
        cli.error("a custom shape needs all of --hidden, --ffn, --heads and --kv-groups")
    shape = Shape(*custom) if all(custom) else SHAPES[args.model]
    if torch.cuda.device_count() < args.tp:
        raise SystemExit(f"tuning needs {args.tp} GPUs on this machine")
    tables = spawn(_tune, args.tp, args, shape)[0]
    out_dir = Path(args.out_dir) if args.out_dir else CACHE_DIR / "tuning"
    out_dir.mkdir(parents=True, exist_ok=True)
    for table in tables:
        key = TableKey(*(table[f.name] for f in dataclasses.fields(TableKey)))
        out = out_dir / key.file_name()
        table["command"] = f"{PROG} " + " ".join(sys.argv[1:] if argv is None else argv)
        out.write_text(json.dumps(table, indent=1))
        print(f"wrote {out}")
        for entry in table["entries"]:
            print("  ", entry)


if __name__ == "__main__":
    main()
