"""Timeline picture of the woven schedule: both CUDA streams of one layer, from a profiler trace.

    python -m megatron_tokenweave.bench timeline --out docs/results/timeline_tp2.png

Profiles rank 0 of a 2-rank block of TokenWeave layers (eager, split forced) with torch.profiler,
keeps the chrome trace next to the picture, and draws the kernels of the second layer per stream.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from megatron_tokenweave.bench import add_model_argument, command_parser
from megatron_tokenweave.launch import spawn
from megatron_tokenweave.models import SHAPES, llama_config

KINDS = (  # (label, substrings of kernel names), first match wins
    ("fused all-reduce+norm", ("fused_allreduce",)),
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("GEMM", ("gemm", "sm90_xmma", "cutlass", "nvjet", "Kernel2")),
)


def _kind(name: str) -> str:
    low = name.lower()
    for label, keys in KINDS:
        if any(k.lower() in low for k in keys):
            return label
    return "other"


def _profile(rank: int, world: int, args: argparse.Namespace) -> list[dict] | None:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.transformer_block import TransformerBlock

    from megatron_tokenweave.bench.sdpa import with_sdpa
    from megatron_tokenweave.config import TokenWeaveConfig
    from megatron_tokenweave.launch import initialize_model_parallel
    from megatron_tokenweave.spec import get_gpt_decoder_block_tokenweave_spec, te_available

    initialize_model_parallel(world)
    shape = SHAPES[args.model]
    cfg = llama_config(shape, 3, world, sequence_parallel=True, bf16=True,
                       params_dtype=torch.bfloat16)
    tw = TokenWeaveConfig(max_tokens=args.tokens, split_threshold=0, tuning_table="none")
    tw = dataclasses.replace(tw, comm_ctas_attn=args.ctas, comm_ctas_mlp=args.ctas)
    spec = get_gpt_decoder_block_tokenweave_spec(
        cfg, te_available(), tw, **shape.spec_kwargs()
    )
    block = TransformerBlock(cfg, spec if te_available() else with_sdpa(spec))
    block = block.cuda().bfloat16().eval()
    rpe = RotaryEmbedding(kv_channels=cfg.kv_channels, rotary_percent=1.0)(args.tokens)
    x = torch.randn(args.tokens // world, 1, shape.hidden, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for _ in range(3):
            block(hidden_states=x, attention_mask=None, rotary_pos_emb=rpe)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            block(hidden_states=x, attention_mask=None, rotary_pos_emb=rpe)
            torch.cuda.synchronize()
    if rank != 0:
        return None
    prof.export_chrome_trace(args.trace)
    with open(args.trace) as f:
        events = json.load(f)["traceEvents"]
    return [
        {"name": e["name"], "ts": e["ts"], "dur": e["dur"], "stream": e["args"].get("stream")}
        for e in events
        if e.get("cat") == "kernel" and "dur" in e
    ]


def _draw(kernels: list[dict], out: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megatron_tokenweave.bench.report import save_plot

    t0 = min(k["ts"] for k in kernels)
    span = max(k["ts"] + k["dur"] for k in kernels) - t0
    # The middle third of the block: the second of three layers.
    lo, hi = t0 + span / 3, t0 + 2 * span / 3
    shown = [k for k in kernels if lo <= k["ts"] <= hi]
    streams = sorted({k["stream"] for k in shown}, key=lambda s: -sum(
        k["dur"] for k in shown if k["stream"] == s))
    colors = {"GEMM": "tab:blue", "attention": "tab:green", "fused all-reduce+norm": "tab:red",
              "other": "tab:gray"}
    fig, ax = plt.subplots(figsize=(14, 2.6))
    for row, stream in enumerate(streams):
        for k in shown:
            if k["stream"] == stream:
                ax.broken_barh([((k["ts"] - lo) / 1e3, k["dur"] / 1e3)], (row - 0.4, 0.8),
                               color=colors[_kind(k["name"])])
    ax.set_yticks(range(len(streams)))
    ax.set_yticklabels([f"stream {s}" + (" (main)" if i == 0 else " (side)")
                        for i, s in enumerate(streams)])
    ax.set_xlabel("ms")
    ax.set_title(title)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(handles, list(colors), loc="upper right", ncol=4, fontsize=8)
    fig.tight_layout()
    save_plot(fig, out, dpi=120)


def parser() -> argparse.ArgumentParser:
    parser = command_parser("timeline", __doc__)
    add_model_argument(parser, "model shape")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of the profiled forward")
    parser.add_argument("--ctas", type=int, default=16,
                        help="CTAs of the fused op in each phase")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks, one GPU each")
    parser.add_argument("--out", default="docs/results/timeline_tp2.png",
                        help="picture (PNG); the chrome trace goes beside it (_trace.json)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    args.trace = args.out.replace(".png", "_trace.json")
    kernels = spawn(_profile, args.tp, args)[0]
    _draw(kernels, args.out, f"{args.model}, {args.tokens} tokens, TP={args.tp}, "
          f"sequence parallel, split, {args.ctas} CTAs: second of three layers")
    print(f"wrote {args.out} and {args.trace}")


if __name__ == "__main__":
    main()
