"""End-to-end benchmark through Megatron's inference engines: stock spec vs TokenWeave spec.

    python -m megatron_tokenweave.bench e2e --out docs/results/e2e_tp2.json

One 2-rank NCCL run builds a GPTModel with `--layers` layers of a model shape (random weights,
the shape's real vocabulary, bf16) with Megatron's TE spec (`te`; the local spec, `local`, where
TE does not import) and the same weights with the TokenWeave spec (`tokenweave`), then measures,
interleaving the two models:
  prefill_ms    static engine, batch 1, a prompt of N tokens, one output token: wall time of
                `engine.generate` (median of --reps); also for `<stock>_nocomm`, the stock model
                with its tensor-parallel all-reduces made no-ops (bench/nocomm.py): the ceiling
                of any communication overlap
  tokens_per_s  --prompts prompts of mixed lengths (--mixed-min..--mixed-max tokens, log-uniform)
                with exactly N greedy tokens each, one workload per --output-tokens value N (no
                early stop: every model does the same work): (prompt + generated tokens) / wall
                time, the models interleaved pass by pass.
                Through the dynamic engine (MegatronLLM, chunked prefill of --chunk tokens) where
                it can run (serving.engines.dynamic_engine_problem), else the static engine
                (lengths rounded to powers of sqrt(2) and batches of equal-length prompts, so a
                batch's prefill is one forward). The row says which. Also `<stock>_nocomm`
                (the ceiling) unless the engine runs CUDA graphs (their captures hold the
                collectives; a ceiling there needs a model captured without them).
With `--fp8-recipe R` both models run their GEMMs in TE's FP8 recipe R (e4m3); every row says its
`precision`. A woven FP8 forward takes multiples of 16 rows per chunk; other counts take the
stock path (as Megatron's FP8 inference padding would then pad them).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import statistics
import time
from collections.abc import Callable

import torch

from megatron_tokenweave.bench import (
    add_fp8_recipe_argument,
    add_model_argument,
    check_fp8_recipe,
    command_parser,
)
from megatron_tokenweave.bench.nocomm import no_tp_comm
from megatron_tokenweave.bench.report import grouped_bars, save_plot, write_result
from megatron_tokenweave.launch import spawn
from megatron_tokenweave.models import SHAPES
from megatron_tokenweave.precision import bench_precision, fp8_fields


def _wall(fn: Callable[[], object]) -> float:
    """Seconds of fn(), GPU work included; every rank starts together."""
    torch.distributed.barrier()
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def _text(tokens: int, gen: torch.Generator) -> str:
    """A prompt of exactly `tokens` byte tokens (printable ASCII, never the eod byte)."""
    return bytes(torch.randint(32, 127, (tokens,), generator=gen).tolist()).decode()


def _workload(args: argparse.Namespace, buckets: bool) -> list[str]:
    """The mixed prompts, the same on every rank. With `buckets` (static engine) the lengths are
    rounded to powers of sqrt(2), so that prompts of equal length can share a batch."""
    gen = torch.Generator().manual_seed(7)
    lo, hi = math.log2(args.mixed_min), math.log2(args.mixed_max)
    exps = lo + (hi - lo) * torch.rand(args.prompts, generator=gen, dtype=torch.float64)
    if buckets:
        exps = torch.round(exps * 2) / 2
    return [_text(int(round(2 ** float(e))), gen) for e in exps]


def _prefill_rows(models: dict, stock: str, tokenizer, args: argparse.Namespace,
                  say) -> list[dict]:
    """Prefill latency: static engine, batch 1, one output token (its engines die with it), for
    each model and for the stock model without communication (one output token: every rank
    stops after it, whatever its unreduced logits chose)."""
    from megatron_tokenweave.serving.engines import greedy, static_engine

    rows = []
    gen = torch.Generator().manual_seed(3)
    runs = {name: (model, contextlib.nullcontext) for name, model in models.items()}
    runs[f"{stock}_nocomm"] = (models[stock], no_tp_comm)
    for tokens in args.prefill_tokens:
        prompt = _text(tokens, gen)
        engines = {name: (static_engine(m, tokenizer, 1, tokens + 2), ctx)
                   for name, (m, ctx) in runs.items()}
        samples: dict[str, list[float]] = {name: [] for name in engines}
        for rep in range(args.reps + 2):
            for name, (engine, ctx) in engines.items():
                with ctx():
                    seconds = _wall(lambda e=engine, p=prompt: e.generate(
                        prompts=[p], sampling_params=greedy(1)))
                if rep >= 2:  # two warm-up rounds
                    samples[name].append(seconds)
        for name, values in samples.items():
            rows.append(dict(metric="prefill_ms", impl=name, prompt_tokens=tokens,
                             value=round(1e3 * statistics.median(values), 3), engine="static"))
        say(f"prefill {tokens}: " + "  ".join(
            f"{n}={1e3 * statistics.median(v):.1f}ms" for n, v in samples.items()), flush=True)
    return rows


def _run(rank: int, world: int, args: argparse.Namespace) -> list[dict]:
    from megatron_tokenweave.config import TokenWeaveConfig
    from megatron_tokenweave.launch import initialize_model_parallel
    from megatron_tokenweave.models import stock_and_tokenweave
    from megatron_tokenweave.serving.tokenizer import ByteTokenizer
    from megatron_tokenweave.spec import te_available

    initialize_model_parallel(world)
    shape = SHAPES[args.model]
    te = te_available() and not args.local
    stock_name = "te" if te else "local"
    max_seq = max(max(args.prefill_tokens), args.mixed_max + max(args.output_tokens)) + 8
    tw_config = TokenWeaveConfig(max_tokens=max(
        max(args.prefill_tokens), args.max_batch * args.mixed_max, args.chunk))
    models = dict(zip((stock_name, "tokenweave"), stock_and_tokenweave(
        shape, args.layers, world, tw_config, te, max_seq, **fp8_fields(args.fp8_recipe)),
        strict=True))
    tokenizer = ByteTokenizer(shape.vocab)
    rows: list[dict] = []
    say = print if rank == 0 else (lambda *a, **k: None)

    if "prefill" in args.metrics:
        rows += _prefill_rows(models, stock_name, tokenizer, args, say)
    if "throughput" in args.metrics:
        rows += _throughput_rows(models, stock_name, shape, tokenizer, tw_config, te, max_seq,
                                 args, say)
    precision = bench_precision(args.fp8_recipe)
    for row in rows:
        row.update(model=args.model, layers=args.layers, tp=world, precision=precision)
    return rows


def _throughput_rows(models: dict, stock_name: str, shape, tokenizer, tw_config, te: bool,
                     max_seq: int, args: argparse.Namespace, say) -> list[dict]:
    """Throughput: the mixed prompts through the dynamic engine (else the static one)."""
    from megatron_tokenweave.models import clear_attention_backend_env, stock_and_tokenweave
    from megatron_tokenweave.serving.engines import (
        dynamic_config_overrides,
        dynamic_engine_problem,
        dynamic_llm,
        greedy,
        static_engine,
    )

    world = torch.distributed.get_world_size()
    rows: list[dict] = []
    use_dynamic = args.engine == "dynamic" or (
        args.engine == "auto" and dynamic_engine_problem() is None)
    scope = args.cuda_graph_scope if args.cuda_graphs else None
    if use_dynamic and (overrides := dynamic_config_overrides(scope)):
        # The dynamic engine's attention needs other config fields: a pair of its own.
        models.clear()
        gc.collect()  # the prefill engines' reference cycles may still hold the first pair
        torch.cuda.empty_cache()
        clear_attention_backend_env()
        models = dict(zip((stock_name, "tokenweave"), stock_and_tokenweave(
            shape, args.layers, world, tw_config, te, max_seq, **overrides,
            **fp8_fields(args.fp8_recipe)), strict=True))
    prompts = _workload(args, buckets=not use_dynamic)
    prompt_tokens = sum(len(p) for p in prompts)
    runs: dict[str, tuple[Callable[[object], int], Callable]] = {}
    for name, model in models.items():
        if use_dynamic:
            llm = dynamic_llm(model, tokenizer, max_seq, max_requests=args.max_batch,
                              chunk_tokens=args.chunk, buffer_size_gb=args.kv_gb,
                              cuda_graphs=args.cuda_graphs)
            token_lists = [list(p.encode()) for p in prompts]

            def run(sampling, llm=llm, token_lists=token_lists) -> int:
                done = llm.generate(token_lists, sampling)
                return sum(len(r.generated_tokens) for r in done)
        else:
            by_length: dict[int, list[str]] = {}
            for p in prompts:
                by_length.setdefault(len(p), []).append(p)
            engine = static_engine(model, tokenizer, args.max_batch, max_seq)

            def run(sampling, engine=engine, by_length=by_length) -> int:
                generated = 0
                for same in by_length.values():
                    for i in range(0, len(same), args.max_batch):
                        done = engine.generate(prompts=same[i : i + args.max_batch],
                                               sampling_params=sampling)
                        generated += sum(len(r.generated_tokens) for r in done)
                return generated
        runs[name] = (run, contextlib.nullcontext)
    if not (use_dynamic and args.cuda_graphs):
        runs[f"{stock_name}_nocomm"] = (runs[stock_name][0], no_tp_comm)
    for output_tokens in args.output_tokens:
        # No request stops early, whatever its (for the ceiling: unreduced) logits choose, so
        # every model generates the same number of tokens on every rank.
        sampling = greedy(output_tokens, stop_at_eod=False)
        samples, generated = _interleaved_throughput(runs, sampling, prompt_tokens,
                                                     args.throughput_reps)
        for name, values in samples.items():
            rows.append(dict(metric="tokens_per_s", impl=name, prompt_tokens=prompt_tokens,
                             value=round(statistics.median(values), 1),
                             engine="dynamic" if use_dynamic else "static",
                             prompts=len(prompts), output_tokens=output_tokens,
                             cuda_graphs=args.cuda_graphs if use_dynamic else 0,
                             cuda_graph_scope=scope, generated_tokens=generated[name]))
        say(f"throughput ({output_tokens} output tokens): " + "  ".join(
            f"{n}={statistics.median(v):.0f} tok/s" for n, v in samples.items()), flush=True)
    return rows


def _interleaved_throughput(runs: dict, sampling, prompt_tokens: int,
                            reps: int) -> tuple[dict[str, list[float]], dict[str, int]]:
    """(prompt + generated tokens) / second of each run, one warm-up pass each, then `reps`
    rounds that run every model once in turn (drift hits them alike); and what each generated."""
    for run, ctx in runs.values():
        with ctx():
            _wall(lambda run=run: run(sampling))
    samples: dict[str, list[float]] = {name: [] for name in runs}
    generated: dict[str, int] = {}
    for _ in range(reps):
        for name, (run, ctx) in runs.items():
            count = [0]
            with ctx():
                seconds = _wall(lambda run=run, count=count: count.__setitem__(0, run(sampling)))
            generated[name] = count[0]
            samples[name].append((prompt_tokens + count[0]) / seconds)
    return samples, generated


def _plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    stock = next(r["impl"] for r in rows if r["impl"] in ("te", "local"))
    pre = {(r["impl"], r["prompt_tokens"]): r["value"] for r in rows
           if r["metric"] == "prefill_ms"}
    tput = {(r["impl"], r.get("output_tokens", 0)): r for r in rows
            if r["metric"] == "tokens_per_s"}
    panels = int(bool(pre)) + int(bool(tput))
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4), squeeze=False)
    axes = list(axes[0])
    if pre:
        ax = axes.pop(0)
        _plot_speedups(ax, {k: 1.0 / v for k, v in pre.items()}, stock, "prompt tokens")
        ax.set_title(f"prefill latency, batch 1: speed-up over {stock}")
    if tput:
        ax = axes.pop(0)
        _plot_speedups(ax, {k: r["value"] for k, r in tput.items()}, stock,
                       "generated tokens per prompt")
        first = next(iter(tput.values()))
        graphs = f", {first['cuda_graphs']} graphs" if first.get("cuda_graphs") else ""
        ax.set_title(f"throughput, {first['prompts']} prompts: speed-up over {stock}\n"
                     f"({first['engine']} engine{graphs})")
    fig.suptitle(f"{rows[0]['model']} shapes, {rows[0]['layers']} layers, TP={rows[0]['tp']}")
    fig.tight_layout()
    save_plot(fig, path, dpi=110)


def _plot_speedups(ax, speed: dict, stock: str, xlabel: str) -> None:
    """Bars of impl speed / stock speed per workload (tokenweave, the ceiling); `speed` maps
    (impl, workload) to a higher-is-better figure."""
    workloads = sorted({w for _, w in speed})
    impls = [i for i in ("tokenweave", f"{stock}_nocomm") if any(k[0] == i for k in speed)]
    grouped_bars(ax, workloads,
                 {i: [speed[(i, w)] / speed[(stock, w)] for w in workloads] for i in impls},
                 value_labels=True)
    ax.set_xlabel(xlabel)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.legend(loc="lower right")


def parser() -> argparse.ArgumentParser:
    parser = command_parser("e2e", __doc__)
    add_model_argument(parser, "model shape")
    parser.add_argument("--layers", type=int, default=4, help="layers of the model")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks, one GPU each")
    parser.add_argument("--prefill-tokens", nargs="+", type=int, default=[1024, 2048, 4096, 8192],
                        help="prefill: prompt lengths timed (batch 1, one output token)")
    parser.add_argument("--reps", type=int, default=5, help="prefill: timings per length (median)")
    parser.add_argument("--engine", choices=["auto", "dynamic", "static"], default="auto",
                        help="throughput: the engine; auto: dynamic where it can run here")
    # The throughput workload and engine sizes: (option, type, default, help).
    for flag, kind, default, text in (
        ("--prompts", int, 200, "throughput: prompts in the workload"),
        ("--mixed-min", int, 128, "throughput: shortest prompt, tokens (lengths log-uniform)"),
        ("--mixed-max", int, 4096, "throughput: longest prompt, tokens"),
        ("--max-batch", int, 16, "static engine: prompts per batch; dynamic: concurrent requests"),
        ("--chunk", int, 2048, "dynamic engine: chunked-prefill tokens per step"),
        ("--kv-gb", float, 16.0, "dynamic engine: KV cache, GB"),
        ("--throughput-reps", int, 2, "throughput: passes of the workload per model"),
        ("--cuda-graphs", int, 0, "dynamic engine: at most this many inference CUDA graphs "
                                  "(0: eager)"),
    ):
        parser.add_argument(flag, type=kind, default=default, help=text)
    parser.add_argument("--output-tokens", nargs="+", type=int, default=[32],
                        help="throughput: one workload per value (generated tokens per prompt)")
    parser.add_argument("--cuda-graph-scope", choices=["layer", "block"], default="layer",
                        help="with --cuda-graphs: a graph per layer or per decoder block")
    parser.add_argument("--local", action="store_true", help="local specs even with TE")
    add_fp8_recipe_argument(parser, "both models' GEMMs")
    parser.add_argument("--metrics", nargs="+", choices=["prefill", "throughput"],
                        default=["prefill", "throughput"], help="what to measure")
    parser.add_argument("--out", default="docs/results/e2e_tp2.json",
                        help="result JSON (plot beside it)")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return parser().parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    check_fp8_recipe(args)
    if torch.cuda.device_count() < args.tp:
        raise SystemExit(f"the end-to-end benchmark needs {args.tp} GPUs")
    rows = spawn(_run, args.tp, args)[0]
    write_result("e2e", argv, rows, args.out, _plot)


if __name__ == "__main__":
    main()
