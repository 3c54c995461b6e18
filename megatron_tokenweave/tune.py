"""Autotuner: measure the split policy table for a model shape on this machine.

    python -m megatron_tokenweave.tune --model llama-3.3-70b --tp 2

For every token count of the grid it times, interleaved and as CUDA-graph replays, a block of
TokenWeave layers with the tokens not split (several CTA counts) and split (several CTA counts
per phase), and keeps the fastest. The table goes to the cache that `TokenWeaveConfig(tuning_table=
"auto")` reads (~/.cache/megatron_tokenweave/tuning/, or TOKENWEAVE_CACHE), or to --out.
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

from megatron_tokenweave.launch import spawn
from megatron_tokenweave.models import SHAPES, Shape, llama_config
from megatron_tokenweave.policy import CACHE_DIR, TableKey

NEVER = 1 << 40
ALONE_CTAS = (16, 32, 64, 128)
SPLIT_CTAS = ((8, 8), (16, 16), (32, 32), (16, 32), (32, 16))
CARVEOUT = ((8, 8), (16, 16))  # (ctas, SMs the split GEMMs leave free)


def candidates() -> dict[str, dict]:
    """Name -> TokenWeaveConfig overrides of every candidate plan."""
    out = {f"alone{c}": dict(split_threshold=NEVER, comm_ctas_alone=c) for c in ALONE_CTAS}
    out.update({
        f"split{a}/{m}": dict(split_threshold=0, comm_ctas_attn=a, comm_ctas_mlp=m)
        for a, m in SPLIT_CTAS
    })
    out.update({
        f"split{c}/{c}c{sms}": dict(split_threshold=0, comm_ctas_attn=c, comm_ctas_mlp=c,
                                    gemm_sm_carveout=sms)
        for c, sms in CARVEOUT
    })
    return out


def _progress(done: int, total: int, text: str, start: float) -> None:
    width = 30
    filled = width * done // total
    elapsed = time.time() - start
    bar = "#" * filled + "." * (width - filled)
    sys.stdout.write(f"\r[{bar}] {done}/{total} {elapsed:5.0f}s {text:<40}")
    sys.stdout.flush()


def _tune(rank: int, world: int, args: argparse.Namespace, shape: Shape) -> dict:
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
    cfg = llama_config(shape, args.layers, world, sequence_parallel=args.sequence_parallel,
                       bf16=True, params_dtype=dtype)
    base = TokenWeaveConfig(max_tokens=max(args.tokens), tuning_table="none")
    spec = get_gpt_decoder_block_tokenweave_spec(cfg, use_te, base, **shape.spec_kwargs())
    block = TransformerBlock(cfg, spec if use_te else with_sdpa(spec)).cuda().to(dtype).eval()
    rope = RotaryEmbedding(kv_channels=cfg.kv_channels, rotary_percent=1.0)
    plans = candidates()
    total, done, start = len(args.tokens) * len(plans), 0, time.time()
    entries, measured = [], {}
    for tokens in args.tokens:
        seq = tokens
        local = seq // world if args.sequence_parallel else seq
        x = torch.randn(local, 1, shape.hidden, device="cuda", dtype=dtype)
        rpe = rope(seq)
        replays = {}
        with torch.no_grad():
            for name, overrides in plans.items():
                for layer in block.layers:
                    layer.tokenweave_config = dataclasses.replace(base, **overrides)
                replays[name] = graphed(
                    lambda i, x=x, rpe=rpe: block(hidden_states=x, attention_mask=None,
                                                  rotary_pos_emb=rpe)
                )
                done += 1
                if rank == 0:
                    _progress(done, total, f"T={tokens} {name}", start)
            times = interleaved_medians(replays, iters=args.iters, warmup=3)
        del replays
        torch.cuda.empty_cache()
        best = min(times, key=times.get)
        measured[tokens] = {k: round(v, 1) for k, v in times.items()}
        overrides = dict(plans[best])
        entry = {"min_tokens": 0 if not entries else tokens,
                 "split": overrides.pop("split_threshold") == 0, **overrides}
        entries.append(entry)
        if time.time() - start > args.budget_s:
            break
    key = TableKey.of(torch.device("cuda"), world, shape.hidden, dtype)
    return {**dataclasses.asdict(key), "entries": entries, "measured_us": measured,
            "layers": args.layers, "sequence_parallel": args.sequence_parallel}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Measure TokenWeave's split-policy table")
    parser.add_argument("--model", default="llama-3.3-70b", choices=sorted(SHAPES))
    parser.add_argument("--hidden", type=int, help="custom shape: hidden size (with --ffn ...)")
    parser.add_argument("--ffn", type=int)
    parser.add_argument("--heads", type=int)
    parser.add_argument("--kv-groups", type=int)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", nargs="+", type=int, default=[256, 512, 1024, 2048, 4096, 8192])
    parser.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_false")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--budget-s", type=float, default=540.0, help="stop adding token counts")
    parser.add_argument("--out", help="table path (default: the cache the layer reads)")
    args = parser.parse_args(argv)
    shape = SHAPES[args.model]
    if args.hidden:
        shape = Shape(args.hidden, args.ffn, args.heads, args.kv_groups)
    if torch.cuda.device_count() < args.tp:
        raise SystemExit(f"tuning needs {args.tp} GPUs on this machine")
    table = spawn(_tune, args.tp, args, shape)[0]
    name = f"{table['gpu'].replace(' ', '_')}_tp{table['tp']}_h{table['hidden']}_{table['dtype']}"
    out = Path(args.out) if args.out else CACHE_DIR / "tuning" / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(table, indent=1))
    print(f"\nwrote {out}")
    for entry in table["entries"]:
        print("  ", entry)


if __name__ == "__main__":
    main()
