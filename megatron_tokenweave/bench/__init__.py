"""Benchmarks: `python -m megatron_tokenweave.bench COMMAND [options]` (`--help` lists them)."""

from __future__ import annotations

import argparse

PROG = "python -m megatron_tokenweave.bench"  # every benchmark's usage line starts with it


def command_parser(command: str, doc: str) -> argparse.ArgumentParser:
    """One benchmark command's parser: its usage line under PROG, the first paragraph of its
    module docstring as the description, defaults shown in --help."""
    return argparse.ArgumentParser(prog=f"{PROG} {command}", description=doc.split("\n\n")[0],
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)


def add_model_argument(parser: argparse.ArgumentParser, what: str = "model shape") -> None:
    """--model: one of megatron_tokenweave.models.SHAPES."""
    from megatron_tokenweave.models import SHAPES

    parser.add_argument("--model", default="llama-3.3-70b", choices=sorted(SHAPES),
                        metavar="MODEL", help=f"{what}, of {', '.join(sorted(SHAPES))}")


def add_sweep_arguments(parser: argparse.ArgumentParser, *, tokens: list[int], iters: int,
                        timed: str, out: str, tokens_help: str = "tokens of one forward") -> None:
    """--tokens, --iters and --out of a benchmark that times candidates (`timed`: what one
    timed replay runs) over token counts and writes a result JSON with its plot beside it."""
    parser.add_argument("--tokens", nargs="+", type=int, default=tokens, help=tokens_help)
    parser.add_argument("--iters", type=int, default=iters,
                        help=f"timed replays per {timed} (interleaved; medians)")
    parser.add_argument("--out", default=out, help="result JSON (plot beside it)")


def add_fp8_recipe_argument(parser: argparse.ArgumentParser, what: str) -> None:
    """--fp8-recipe: none, or one of the TE FP8 recipes the woven layer weaves."""
    from megatron_tokenweave.precision import WOVEN_FP8_RECIPES

    parser.add_argument("--fp8-recipe", default="none", choices=["none", *WOVEN_FP8_RECIPES],
                        help=f"{what} in this TE FP8 recipe (e4m3; TE needed)")


def check_fp8_recipe(args: argparse.Namespace) -> None:
    """Refuse an FP8 recipe the benchmark cannot run before any rank starts: TE's FP8 GEMMs,
    so neither with --local specs nor without TransformerEngine."""
    if args.fp8_recipe == "none":
        return
    if args.local:
        raise SystemExit("--fp8-recipe runs TE's FP8 GEMMs: not with --local")
    from megatron_tokenweave.spec import te_available

    if not te_available():
        raise SystemExit("--fp8-recipe needs TransformerEngine")
