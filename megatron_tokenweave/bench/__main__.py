"""`python -m megatron_tokenweave.bench COMMAND [options]`: run one benchmark
(megatron_tokenweave.bench.COMMAND.main); `--help` lists them, `COMMAND --help` its options."""

from __future__ import annotations

import argparse
import importlib
import sys

from megatron_tokenweave.bench import PROG

COMMANDS = {  # one line each in --help (80 columns)
    "kernel": "the fused op vs NCCL, FlashInfer, symmetric memory (2 GPUs)",
    "block": "decoder block: stock, its no-comm ceiling, TokenWeave (2 GPUs)",
    "e2e": "prefill and throughput through Megatron's engines (2 GPUs)",
    "timeline": "both CUDA streams of one woven layer, as a picture (2 GPUs)",
    "split_cost": "what the token split costs the GEMMs (1 GPU)",
    "gemm_fused": "the communicating GEMM vs cuBLAS and TE's GEMM (1 GPU)",
    "gemm_pair": "row GEMM + all-reduce + norm per mechanism, split or not (2 GPUs)",
    "call_check": "what checking every peer's call costs the one-shot path (1 GPU)",
    "fp8_rows": "the op writing FP8 rows vs the op + TE's quantizer (1 GPU)",
}


def parser() -> argparse.ArgumentParser:
    """The command list; each command parses its own options."""
    width = max(map(len, COMMANDS))
    listing = "\n".join(f"  {name:<{width}}  {summary}" for name, summary in COMMANDS.items())
    parser = argparse.ArgumentParser(
        prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="TokenWeave benchmarks; each writes a result JSON and a plot.",
        epilog=f"commands:\n{listing}\n\n`{PROG} COMMAND --help` lists a command's options.")
    parser.add_argument("command", choices=COMMANDS, metavar="COMMAND",
                        help="the benchmark to run (commands below)")
    parser.add_argument("options", nargs=argparse.REMAINDER, help="the command's options")
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in COMMANDS:
        importlib.import_module(f"megatron_tokenweave.bench.{argv[0]}").main(argv[1:])
        return
    parser().parse_args(argv)  # --help; else the usage and what is wrong


if __name__ == "__main__":
    main()
